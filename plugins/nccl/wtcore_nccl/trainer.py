"""The sender: packs buckets into reused buffers and broadcasts them, pipelined.

Large tensors are broadcast in place, straight from the source (:mod:`wtcore_nccl.plan`).

Every worker RPC (the init handshake and the round's single ``update_weights``)
runs on a helper thread while this thread joins the group or broadcasts, because both block
until the other side takes part. Every wait polls the RPC, so a rejected call fails the
round at once; the helper thread is never joined on the error path.

Any failure inside a round tears the group down (a half-finished sequence of broadcasts
cannot be resumed safely) and the next ``send_weights`` runs the handshake again.
"""

from __future__ import annotations

import secrets
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

from wtcore.buckets import pack_source
from wtcore.concurrency import BackgroundCall
from wtcore.errors import MetadataMismatchError, TransferError
from wtcore.kit import BucketedTrainerEngine
from wtcore.meta import metas_to_wire
from wtcore.sink import on_device
from wtcore.trainer import TrainerInitInfo
from wtcore_nccl.config import NCCLTrainerInitInfo
from wtcore_nccl.frames import make_header
from wtcore_nccl.group import GENERATION_KEY, Group, host_store, join_group, release_group
from wtcore_nccl.pipeline import BufferPool, wait_work
from wtcore_nccl.plan import plan_nccl
from wtcore_nccl.status import host_status

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from wtcore.buckets import Bucket
    from wtcore.client import WeightSyncClient
    from wtcore.meta import ParamMeta
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = ["NCCLTrainerEngine"]

#: After a failure, how long the sender waits for the worker RPC to report its side.
_ERROR_GRACE_S = 5.0


def _fail_fast(rpc: BackgroundCall[Any]) -> Any:
    def poll() -> None:
        err = rpc.error
        if err is not None:
            raise err

    return poll


class _RoundCalls:
    """A round's control calls, off the critical path: start, then at once ``update_weights``.

    A helper thread sends ``start_weight_update`` and, as soon as it returned, launches the
    round's single ``update_weights`` (on a thread of its own: it returns only once the whole
    round was received), while this thread reads and packs the first bucket; :meth:`open`,
    called before the first broadcast, waits for that. The start's round trip no longer adds
    to the round.
    """

    def __init__(self, client: WeightSyncClient, metas: list[ParamMeta], timeout_s: float):
        self.timeout_s = timeout_s
        self.rpc: BackgroundCall[None] | None = None
        wire = metas_to_wire(metas)

        def start_then_update() -> None:
            client.start_weight_update()
            self.rpc = BackgroundCall(client.update_weights, wire, name="update_weights")

        self.start: BackgroundCall[None] = BackgroundCall(
            start_then_update, name="start_weight_update"
        )

    def open(self, stats: TransferStats) -> BackgroundCall[None]:
        """Wait for the start (bounded); the ``update_weights`` call it launched."""
        if self.rpc is None:
            with stats.phase("control"):
                self.start.result(self.timeout_s)
        assert self.rpc is not None
        return self.rpc

    def settle(self) -> BackgroundCall[None] | None:
        """After a failure: let the start end (bounded); the update call, if it was sent."""
        self.start.wait(min(_ERROR_GRACE_S, self.timeout_s))
        return self.rpc

    def poll(self) -> None:
        """Between short waits: raise a call's error at once (fail fast)."""
        call = self.rpc if self.rpc is not None else self.start
        err = call.error
        if err is not None:
            raise err

    def update_result(self, stats: TransferStats) -> None:
        self.open(stats).result(self.timeout_s)


class NCCLTrainerEngine(BucketedTrainerEngine):
    """Trainer half of the ``nccl`` engine (see the module docstring).

    Built on the kit's options, update info and handshake hook; it keeps a pipeline of its
    own (one round-long ``update_weights`` call, broadcasts in flight on reused buffers), so
    it overrides ``_send``.
    """

    init_info_cls = NCCLTrainerInitInfo

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None,
    ) -> None:
        super().__init__(init_info, client=client, source=source)
        assert isinstance(init_info, NCCLTrainerInitInfo)
        self.info: NCCLTrainerInitInfo = init_info
        self._store: Any = None
        self._group: Group | None = None
        self._headers: list[dist.Work] = []  # this round's header broadcasts
        self._pool = BufferPool(
            init_info.packed_num_buffers, init_info.packed_buffer_size_bytes, init_info.device
        )

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    # ------------------------------------------------------------------ handshake
    def handshake(self) -> None:
        """Start a new handshake: ship the worker init info while joining the group.

        Every handshake draws a new rendezvous secret (its key prefix in the store), which
        only the receivers learn, inside the init call.
        """
        assert self.client is not None
        info = self.info
        if self._store is None:  # the first handshake: this process hosts the rendezvous
            if info.torch_num_threads is not None:
                import torch

                torch.set_num_threads(info.torch_num_threads)
            self._store = host_store(
                info.master_address, info.master_port, info.world_size, info.timeout_s
            )
        release_group(self._group)
        self._group = None
        generation = int(self._store.add(GENERATION_KEY, 1))
        secret = secrets.token_hex(16)
        rpc = BackgroundCall(
            self.client.init_weight_transfer_engine,
            info.worker_init_info(secret).to_wire(),
            name="init_weight_transfer_engine",
        )
        group = join_group(
            self._store,
            generation=generation,
            rank=0,
            world_size=info.world_size,
            transport=info.resolved_transport,
            address=info.master_address,
            port=info.master_port,
            timeout_s=info.timeout_s,
            poll=_fail_fast(rpc),
            secret=secret,
            broadcast=info.resolved_broadcast,
        )
        try:
            rpc.result(info.timeout_s)
        except BaseException:
            release_group(group)
            raise
        self._group = group

    # ------------------------------------------------------------------ one round
    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        assert self.client is not None
        group = self._group
        assert group is not None, "a failed round sets needs_handshake; send_weights re-joins"
        metas = source.metadata()
        stats.num_tensors = len(metas)
        stats.num_bytes = sum(m.nbytes for m in metas)
        calls = _RoundCalls(self.client, metas, self.info.timeout_s)
        inflight: deque[tuple[dist.Work, str, int, Any]] = deque()
        self._headers = []
        try:
            self._send_frames(group, source, metas, stats, calls, inflight)
            with stats.phase("control"):
                calls.update_result(stats)
        except BaseException as e:
            rpc = calls.settle()
            if rpc is None:  # the round never got its update: nothing was broadcast
                self._close_group(None)
                raise
            cause = self._abort(e, rpc, [w for w, *_ in inflight])
            inflight.clear()
            if cause is not None:
                raise cause from e
            raise
        self._headers = []
        with stats.phase("control"):
            self.client.finish_weight_update(stats.weight_version)

    def _send_frames(
        self,
        group: Group,
        source: WeightSource,
        metas: list[ParamMeta],
        stats: TransferStats,
        calls: _RoundCalls,
        inflight: deque[tuple[dist.Work, str, int, Any]],
    ) -> None:
        """Broadcast every bucket: packed ones from reused buffers, single tensors in place.

        Broadcasts in flight are bounded by :meth:`BufferPool.has_room`; each keeps what it
        reads (its buffer, or the source tensor) alive until it completed, and a buffer is
        packed again only once its previous broadcast completed.
        """
        import torch

        info, pool = self.info, self._pool
        timeout = info.timeout_s
        buckets = plan_nccl(
            metas,
            packed=info.packed,
            buffer_size_bytes=info.packed_buffer_size_bytes,
            direct_min_bytes=info.direct_min_bytes,
        )
        pool.prepare(buckets)
        poll = calls.poll
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

        frames = pack_source(source, metas, buckets, buffer_for, stats, in_place=sendable)
        for bucket, data in frames:
            stats.num_buckets += 1
            if bucket.nbytes == 0:
                continue  # both ends skip empty buckets
            calls.open(stats)  # the first broadcast needs the update announced
            while not pool.has_room(len(inflight), in_place):
                settle_oldest()
            label = f"broadcast of bucket {bucket.index} ({bucket.nbytes} bytes)"
            with stats.phase("wire"):
                work = self._send_frame(group, bucket.index, data)
            held = 0  # bytes of the source held in place until this broadcast completed
            if bucket.index in staged:
                slot = pool.slot_for_last()
                slot.work, slot.label = work, label
            else:
                held = data.numel()
            in_place += held
            inflight.append((work, label, held, data))
            del data
        calls.open(stats)
        end = self._send_end(group, len(buckets))
        inflight.append((end, "the round's end header", 0, None))
        while inflight:
            settle_oldest()
        pool.forget_work()

    def _send_frame(self, group: Group, index: int, data: torch.Tensor) -> dist.Work:
        """Broadcast bucket ``index``: its header (size, and CRC with ``checksum``), then ``data``.

        The header's work needs no wait of its own (the receiver posts the data's receive
        only after the header arrived, and a failure shows on the data's work); it is kept
        for the round only so that a failure path lets the group go after it ended. A
        transport that checks every message's size itself (the stream) needs no header
        unless it carries a CRC: the receiver refuses a message of another size there.
        """
        if group.checks_sizes and not self.info.checksum:
            return group.broadcast(data)
        header = make_header(index, data, self.info.device, checksum=self.info.checksum)
        self._headers.append(group.broadcast(header))
        return group.broadcast(data)

    def _send_end(self, group: Group, num_buckets: int) -> dist.Work:
        """Broadcast the end header (so a receiver can tell a round with buckets left over)."""
        work = group.broadcast(make_header(num_buckets, None, self.info.device))
        self._headers.append(work)
        return work

    # ------------------------------------------------------------------ failure path
    def _abort(
        self, error: BaseException, rpc: BackgroundCall[Any], inflight: list[dist.Work]
    ) -> BaseException | None:
        """Drain what is in flight (bounded), tear the group down, find the root cause.

        Returns the worker RPC's error when the local error is only its echo on the wire
        (a worker rejected the update, so our broadcast failed), else ``None``.
        """
        group = self._group
        self._group = None
        if group is not None:
            group.set_abort(f"{type(error).__name__}: {error}")
        pending = [*inflight, *self._pool.pending(), *self._headers]
        self._headers = []
        t0 = time.monotonic()

        def give_up_when_rpc_ended() -> None:
            if rpc.done() and time.monotonic() - t0 > 1.0:
                raise TransferError("worker RPC ended; not draining further")

        for work in pending:
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
        release_group(group, pending)
        del pending, group
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # drop frame refs to the group's work
        # Let the workers end their side (they see the group close), so that when
        # send_weights raises, every receiver has ended the round too.
        rpc.wait(min(_ERROR_GRACE_S, self.info.timeout_s))
        if (
            not isinstance(error, MetadataMismatchError)
            and rpc.error is not None
            and rpc.error is not error
        ):
            return rpc.error
        return None

    def _close_group(self, pending: list[dist.Work] | None) -> None:
        group, self._group = self._group, None
        release_group(group, pending or [*self._pool.pending(), *self._headers])
        self._headers = []
        self._pool.forget_work()

    def shutdown(self) -> None:
        """Release the group, the store and the buffers. Idempotent."""
        self._close_group(None)
        self._store = None
        super().shutdown()
