"""The sender of a streamed engine: one announcement per round, frames on a channel, pipelined.

The round's single ``update_weights`` runs on a helper thread while this one sends frame after
frame: packed buckets from reused buffers, tensors of at least ``direct_min_bytes`` (and, on a
channel that takes parts, every bucket) straight from the source's storage.
"""

from __future__ import annotations

import time
import traceback
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore.buckets import Bucket, pack_source
from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore.meta import metas_to_wire
from wtcore.sink import on_device
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine
from wtcore_channel.frames import make_header
from wtcore_channel.options import ChannelTrainerInitInfo, plan
from wtcore_channel.parts import gather_source, new_pad, parts_of
from wtcore_channel.pipeline import BufferPool, Channel, Work, wait_work
from wtcore_kit.concurrency import BackgroundCall

if TYPE_CHECKING:
    import torch

    from wtcore.client import WeightSyncClient
    from wtcore.meta import ParamMeta
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = ["ChannelTrainerEngine"]

_ERROR_GRACE_S = 5.0


def _fail_fast(rpc: BackgroundCall[Any]) -> Callable[[], None]:
    def poll() -> None:
        err = rpc.error
        if err is not None:
            raise err

    return poll


class ChannelTrainerEngine(TrainerWeightTransferEngine):
    """Trainer half of a streamed engine: the engine implements :meth:`open_channel` only.

    Worker calls run on a helper thread (they block until this side takes part), and every
    wait polls them, so a rejected call fails the round at once. A failed round releases the
    channel (a half-sent sequence cannot be resumed); the next round re-runs the handshake.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]] = ChannelTrainerInitInfo

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None,
    ) -> None:
        super().__init__(init_info, client=client, source=source)
        assert isinstance(init_info, ChannelTrainerInitInfo)
        self.info: ChannelTrainerInitInfo = init_info
        self._channel: Channel | None = None
        self._headers: list[Work] = []  # this round's header messages
        self._pad: torch.Tensor | None = None  # what the gaps between parts are sent from
        self._pool = BufferPool(
            init_info.packed_num_buffers, init_info.packed_buffer_size_bytes, init_info.device
        )

    # ------------------------------------------------------------------ the hook
    @abstractmethod
    def open_channel(self) -> tuple[dict[str, Any], Callable[[Callable[[], None]], Channel]]:
        """Start a handshake: the JSON init info every receiver gets, and how to join: a
        function given a ``poll`` to call between short waits (it raises the init call's
        error), returning the channel once every receiver joined."""

    # ------------------------------------------------------------------ handshake
    def handshake(self) -> None:
        assert self.client is not None
        self._close_channel(None)
        init_info, join = self.open_channel()
        rpc = BackgroundCall(
            self.client.init_weight_transfer_engine, init_info, name="init_weight_transfer_engine"
        )
        channel = join(_fail_fast(rpc))
        try:
            rpc.result(self.info.timeout_s)
        except BaseException:
            channel.release()
            raise
        self._channel = channel

    # ------------------------------------------------------------------ one round
    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        assert self.client is not None
        channel = self._channel
        assert channel is not None, "a failed round sets needs_handshake; send_weights re-joins"
        metas = source.metadata()
        stats.num_tensors = len(metas)
        stats.num_bytes = sum(m.nbytes for m in metas)
        wire = metas_to_wire(metas)
        rpc = BackgroundCall(self.client.update_weights, wire, name="update_weights")
        inflight: deque[tuple[Work, str, int, Any]] = deque()
        self._headers = []
        sending = True
        try:
            self._send_frames(channel, source, metas, stats, _fail_fast(rpc), inflight)
            sending = False
            with stats.phase("control"):
                rpc.result(self.info.timeout_s)
        except BaseException as e:
            stalled = sending and isinstance(e, TransferTimeoutError)
            cause = self._abort(e, rpc, [w for w, *_ in inflight], stalled=stalled)
            inflight.clear()
            if cause is not None:
                raise cause from e
            raise
        self._headers = []

    def _send_frames(
        self,
        channel: Channel,
        source: WeightSource,
        metas: list[ParamMeta],
        stats: TransferStats,
        poll: Callable[[], None],
        inflight: deque[tuple[Work, str, int, Any]],
    ) -> None:
        """Send every bucket, :meth:`BufferPool.has_room` bounding those in flight; each keeps
        what it reads alive until it completed."""
        import torch

        info, pool = self.info, self._pool
        timeout = info.timeout_s
        buckets = plan(metas, info)
        pool.prepare(buckets)
        empty = torch.empty(0, dtype=torch.uint8, device=info.device)
        staged: set[int] = set()  # buckets packed into a buffer this round
        in_place = 0  # bytes of the source's tensors in flight in place

        def buffer_for(bucket: Bucket) -> torch.Tensor:
            if bucket.nbytes == 0:
                return empty
            slot = pool.slot_for(bucket)
            if slot.work is not None:
                with stats.phase("wire"):
                    wait_work(slot.work, what=slot.label, timeout_s=timeout, poll=poll)
                slot.work = None
            staged.add(bucket.index)
            return slot.buf

        def settle_oldest() -> None:
            nonlocal in_place
            with stats.phase("wire"):
                wait_work(inflight[0][0], what=inflight[0][1], timeout_s=timeout, poll=poll)
            in_place -= inflight.popleft()[2]

        def sendable(t: torch.Tensor) -> bool:
            return on_device(t, info.device)

        parts = None if info.checksum else parts_of(channel)  # a CRC covers a packed buffer
        frames: Iterator[tuple[Bucket, torch.Tensor | list[torch.Tensor], int]]
        if parts is None:
            packed = pack_source(source, metas, buckets, buffer_for, stats, in_place=sendable)
            frames = ((b, d, b.nbytes if b.index in staged else 0) for b, d in packed)
        else:
            if self._pad is None:
                self._pad = new_pad(info.device)
            frames = gather_source(
                source, metas, buckets, buffer_for, stats, in_place=sendable, pad=self._pad
            )
        for bucket, data, staged_bytes in frames:
            stats.num_buckets += 1
            if bucket.nbytes == 0:
                continue  # both ends skip empty buckets
            while not pool.has_room(len(inflight), in_place):
                settle_oldest()
            label = f"message of bucket {bucket.index} ({bucket.nbytes} bytes)"
            with stats.phase("wire"):
                work = self._send_frame(channel, bucket.index, data)
            if bucket.index in staged:
                slot = pool.slot_for_last()
                slot.work, slot.label = work, label
            held = bucket.nbytes - staged_bytes  # bytes of the source held until it completed
            in_place += held
            inflight.append((work, label, held, data))
            del data
            if parts is not None and bucket.index + 1 < len(buckets):
                # Gathering reads (for a sharded source: materializes) the next bucket's
                # tensors before it can be sent: make room for them first.
                upcoming = buckets[bucket.index + 1].nbytes
                while not pool.has_room(len(inflight), in_place + upcoming):
                    settle_oldest()
        end = channel.broadcast(make_header(len(buckets), None, info.device))
        self._headers.append(end)  # the end header: a receiver can tell buckets left over
        inflight.append((end, "the round's end header", 0, None))
        while inflight:
            settle_oldest()
        pool.forget_work()

    def _send_frame(
        self, channel: Channel, index: int, data: torch.Tensor | list[torch.Tensor]
    ) -> Work:
        """Send bucket ``index``: its header, then ``data``. The header's work is kept only
        for the failure path; a channel that checks sizes itself needs no header but a CRC's."""
        if isinstance(data, list):  # in parts: only where sizes are checked, without a CRC
            parts = parts_of(channel)
            assert parts is not None and not self.info.checksum
            return parts.broadcast_parts(data)
        if channel.checks_sizes and not self.info.checksum:
            return channel.broadcast(data)
        header = make_header(index, data, self.info.device, checksum=self.info.checksum)
        self._headers.append(channel.broadcast(header))
        return channel.broadcast(data)

    # ------------------------------------------------------------------ failure path
    def _abort(
        self,
        error: BaseException,
        rpc: BackgroundCall[Any],
        inflight: list[Work],
        *,
        stalled: bool = False,
    ) -> BaseException | None:
        """Drain what is in flight (bounded), release the channel; the worker call's error
        when the local one is only its echo on the wire. ``stalled``: a message never went out
        (its error names the peer): neither is waited for (22 s for a 6 s timeout on tcp)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.set_abort(f"{type(error).__name__}: {error}")
        pending = [*inflight, *self._pool.pending(), *self._headers]
        self._headers = []
        t0 = time.monotonic()

        def give_up_when_rpc_ended() -> None:
            if rpc.done() and time.monotonic() - t0 > 1.0:
                raise TransferError("worker RPC ended; not draining further")

        for work in [] if stalled else pending:
            try:
                wait_work(
                    work,
                    what="draining",
                    timeout_s=max(0.0, self.info.timeout_s - (time.monotonic() - t0)),
                    poll=give_up_when_rpc_ended,
                )
            except Exception:
                break
        self._pool.forget_work()
        if channel is not None:
            channel.release(pending)
        del pending, channel
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # drop frame refs to the channel's work
        # Let the workers end their side, so that every receiver ended the round when we raise.
        rpc.wait(0.0 if stalled else min(_ERROR_GRACE_S, self.info.timeout_s))
        if not isinstance(error, PayloadError) and rpc.error is not None and rpc.error is not error:
            return rpc.error
        return None

    def _close_channel(self, pending: list[Work] | None) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.release(pending or [*self._pool.pending(), *self._headers])
        self._headers = []
        self._pool.forget_work()

    def shutdown(self) -> None:
        self._close_channel(None)
        super().shutdown()
