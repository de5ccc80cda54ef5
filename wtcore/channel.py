"""The kit's streamed engines: one announcement per round, frames on a channel, pipelined.

A bucket engine of :mod:`wtcore.kit` announces every bucket with an ``update_weights`` call
of its own. An engine whose data plane moves messages by itself (a process group, TCP
streams) does better announcing the whole round once and then streaming: the sender starts
the round's single ``update_weights`` (its metadata is the whole round), and while the
receivers plan the same buckets from it, it sends frame after frame on its
:class:`~wtcore.pipeline.Channel`. Everything except the channel is the same for every such
engine, and lives here:

* the plan: packed buckets, and every tensor of at least ``direct_min_bytes`` in a bucket of
  its own that travels in place (sent from the source's tensor, received into the tensor
  the sink offers), skipping both copies (:func:`wtcore.buckets.plan_round`);
* the window: messages in flight on reused buffers (:class:`~wtcore.pipeline.BufferPool`,
  bounded by bytes, not by count);
* the frames: a header (size, index, optional CRC) before every bucket, refused before the
  receive is posted when it disagrees with the plan (:mod:`wtcore.frames`);
* the failure paths: bounded drains, the sender's abort notice, a receive of an abandoned
  round that could still write into the model (settled before the next round writes), and a
  re-handshake before the next round.

An engine implements :meth:`ChannelTrainerEngine.open_channel` (what every receiver learns
at init, and how the sender joins its channel while they are initialized) and
:meth:`ChannelWorkerEngine.open_channel` (how a receiver joins it). ``nccl`` and ``tcp`` are
built this way.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from abc import abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from wtcore.buckets import Bucket, as_bytes, pack_source, plan_round, unpack_bucket
from wtcore.concurrency import BackgroundCall
from wtcore.engine import WeightTransferEngine
from wtcore.errors import MetadataMismatchError, PayloadError, ProtocolStateError, TransferError
from wtcore.frames import HEADER_WORDS, NO_CRC, check_crc, check_header, make_header
from wtcore.kit import BucketedTrainerInitInfo, BucketUpdateInfo
from wtcore.meta import metas_to_wire
from wtcore.pipeline import BufferPool, Channel, Slot, Work, wait_work
from wtcore.sink import direct_destination, on_device
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

if TYPE_CHECKING:
    import torch

    from wtcore.client import WeightSyncClient
    from wtcore.meta import ParamMeta
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_DIRECT_MIN_BYTES",
    "ChannelSettings",
    "ChannelTrainerEngine",
    "ChannelTrainerInitInfo",
    "ChannelUpdateInfo",
    "ChannelWorkerEngine",
    "check_direct",
]

_log = logging.getLogger(__name__)

#: Default size of one packed bucket buffer (docs/benchmarks.md: 1 GiB made a 1 GiB model one
#: bucket, unpipelined, with 1 GiB of staging on each end; 32-256 MiB measured alike).
DEFAULT_BUFFER_SIZE = 64 << 20
#: Default ``direct_min_bytes`` of the trainer: tensors this large travel in place.
DEFAULT_DIRECT_MIN_BYTES = 1 << 20
#: After a failure, how long the sender waits for the worker RPC to report its side.
_ERROR_GRACE_S = 5.0
#: After a failed receive, how long to wait for the sender's abort notice (a clearer error).
_NOTICE_WAIT_S = 1.0
#: How often (in polls of 50 ms) a waiting receiver asks whether the sender gave up.
_ABORT_CHECK_EVERY = 4

InitT = TypeVar("InitT", bound="ChannelSettings")
UpdateT = TypeVar("UpdateT", bound="ChannelUpdateInfo")


def check_direct(value: object) -> None:
    """``direct_min_bytes`` is an integer >= 0 (a ``PayloadError`` naming it otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PayloadError(f"direct_min_bytes: expected an integer >= 0, got {value!r}")


@dataclass
class ChannelTrainerInitInfo(BucketedTrainerInitInfo, abstract=True):
    """The options of every streamed engine, besides the kit's bucket options.

    ``device`` is where the sender stages its buckets. ``direct_min_bytes``: a tensor at
    least this large travels as a bucket of its own and, when it lies on ``device``, is sent
    straight from its storage and received straight into the receiver's parameter (when the
    sink offers it); 0 packs everything. ``checksum``: add a CRC-32 of every bucket to its
    frame header; receivers then verify each bucket before applying it, and stage every
    bucket to do so (:mod:`wtcore.frames`). Sizes are always checked.
    """

    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)
    device: str = field(default="cpu", kw_only=True)
    direct_min_bytes: int = field(default=DEFAULT_DIRECT_MIN_BYTES, kw_only=True)
    checksum: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_direct(self.direct_min_bytes)
        if not isinstance(self.checksum, bool):
            raise PayloadError(f"checksum: expected a bool, got {self.checksum!r}")


class ChannelSettings(Protocol):
    """What a receiver of a streamed engine reads from its init info."""

    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    timeout_s: float
    direct_min_bytes: int
    checksum: bool


@dataclass
class ChannelUpdateInfo(BucketUpdateInfo):
    """All tensors of one round, in order; the bytes travel on the channel."""


def _plan(metas: list[ParamMeta], settings: ChannelSettings) -> list[Bucket]:
    return plan_round(
        metas,
        packed=settings.packed,
        buffer_size_bytes=settings.packed_buffer_size_bytes,
        direct_min_bytes=settings.direct_min_bytes,
    )


def _fail_fast(rpc: BackgroundCall[Any]) -> Callable[[], None]:
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
    called before the first message, waits for that. The start's round trip no longer adds
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


class ChannelTrainerEngine(TrainerWeightTransferEngine):
    """Trainer half of a streamed engine: the engine implements :meth:`open_channel` only.

    Every worker RPC (the init handshake and the round's single ``update_weights``) runs on a
    helper thread while this thread joins the channel or sends, because both block until the
    other side takes part. Every wait polls the RPC, so a rejected call fails the round at
    once; the helper thread is never joined on the error path. Any failure inside a round
    releases the channel (a half-finished sequence of messages cannot be resumed) and the
    next ``send_weights`` runs the handshake again.
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
        self._pool = BufferPool(
            init_info.packed_num_buffers, init_info.packed_buffer_size_bytes, init_info.device
        )

    # ------------------------------------------------------------------ the hook
    @abstractmethod
    def open_channel(self) -> tuple[dict[str, Any], Callable[[Callable[[], None]], Channel]]:
        """Start a handshake: the JSON init info every receiver gets, and how to join.

        The kit sends the init info with ``init_weight_transfer_engine`` on a helper thread
        and meanwhile calls the returned function with a ``poll`` to call between short
        waits (it raises the init call's error, so a rejected init fails at once); it
        returns this handshake's channel once every receiver joined.
        """

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
        calls = _RoundCalls(self.client, metas, self.info.timeout_s)
        inflight: deque[tuple[Work, str, int, Any]] = deque()
        self._headers = []
        try:
            self._send_frames(channel, source, metas, stats, calls, inflight)
            with stats.phase("control"):
                calls.update_result(stats)
        except BaseException as e:
            rpc = calls.settle()
            if rpc is None:  # the round never got its update: nothing was sent
                self._close_channel(None)
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
        channel: Channel,
        source: WeightSource,
        metas: list[ParamMeta],
        stats: TransferStats,
        calls: _RoundCalls,
        inflight: deque[tuple[Work, str, int, Any]],
    ) -> None:
        """Send every bucket: packed ones from reused buffers, single tensors in place.

        Messages in flight are bounded by :meth:`BufferPool.has_room`; each keeps what it
        reads (its buffer, or the source tensor) alive until it completed, and a buffer is
        packed again only once its previous message completed.
        """
        import torch

        info, pool = self.info, self._pool
        timeout = info.timeout_s
        buckets = _plan(metas, info)
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
            calls.open(stats)  # the first message needs the update announced
            while not pool.has_room(len(inflight), in_place):
                settle_oldest()
            label = f"message of bucket {bucket.index} ({bucket.nbytes} bytes)"
            with stats.phase("wire"):
                work = self._send_frame(channel, bucket.index, data)
            held = 0  # bytes of the source held in place until this message completed
            if bucket.index in staged:
                slot = pool.slot_for_last()
                slot.work, slot.label = work, label
            else:
                held = data.numel()
            in_place += held
            inflight.append((work, label, held, data))
            del data
        calls.open(stats)
        end = channel.broadcast(make_header(len(buckets), None, info.device))
        self._headers.append(end)  # the end header: a receiver can tell buckets left over
        inflight.append((end, "the round's end header", 0, None))
        while inflight:
            settle_oldest()
        pool.forget_work()

    def _send_frame(self, channel: Channel, index: int, data: torch.Tensor) -> Work:
        """Send bucket ``index``: its header (size, and CRC with ``checksum``), then ``data``.

        The header's work needs no wait of its own (the receiver posts the data's receive
        only after the header arrived, and a failure shows on the data's work); it is kept
        for the round only so that a failure path lets the channel go after it ended. A
        channel that checks every message's size itself needs no header unless it carries
        a CRC: the receiver refuses a message of another size there.
        """
        if channel.checks_sizes and not self.info.checksum:
            return channel.broadcast(data)
        header = make_header(index, data, self.info.device, checksum=self.info.checksum)
        self._headers.append(channel.broadcast(header))
        return channel.broadcast(data)

    # ------------------------------------------------------------------ failure path
    def _abort(
        self, error: BaseException, rpc: BackgroundCall[Any], inflight: list[Work]
    ) -> BaseException | None:
        """Drain what is in flight (bounded), release the channel, find the root cause.

        Returns the worker RPC's error when the local error is only its echo on the wire
        (a worker rejected the update, so our message failed), else ``None``.
        """
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.set_abort(f"{type(error).__name__}: {error}")
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
        if channel is not None:
            channel.release(pending)
        del pending, channel
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # drop frame refs to the channel's work
        # Let the workers end their side (they see the channel close), so that when
        # send_weights raises, every receiver has ended the round too.
        rpc.wait(min(_ERROR_GRACE_S, self.info.timeout_s))
        if (
            not isinstance(error, MetadataMismatchError)
            and rpc.error is not None
            and rpc.error is not error
        ):
            return rpc.error
        return None

    def _close_channel(self, pending: list[Work] | None) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.release(pending or [*self._pool.pending(), *self._headers])
        self._headers = []
        self._pool.forget_work()

    def shutdown(self) -> None:
        """Release the channel and the buffers. Idempotent."""
        self._close_channel(None)
        super().shutdown()


@dataclass
class _Frame:
    """One posted receive: its work, its label, the header's CRC word, where it lands.

    ``header`` is the header still to be checked when the receive was posted together with
    it (a channel that checks sizes itself), ``header_work`` its receive (it may complete
    after the bytes'); ``crc`` is read from it once it is checked.
    """

    work: Any
    label: str
    crc: int
    data: torch.Tensor
    slot: Slot | None  # None: received in place, into the sink's tensor
    header: torch.Tensor | None = None
    header_work: Any = None


class ChannelWorkerEngine(WeightTransferEngine[InitT, UpdateT], Generic[InitT, UpdateT]):
    """Worker half of a streamed engine: the engine implements :meth:`open_channel`.

    Receives are posted ahead, in bucket order (as far as
    :meth:`~wtcore.pipeline.BufferPool.has_room` allows), so the next buckets are on the wire
    while the sink copies the current one. Every wait is bounded by the timeout and polls for
    a shutdown, an abort and the sender's abort notice, so a trainer that abandons a round
    ends this worker's ``update_weights`` with an error instead of leaving it blocked. After a
    failed round the channel is dropped; the trainer runs the init handshake again before its
    next round.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init: InitT | None = None
        self._channel: Channel | None = None
        self._pool: BufferPool | None = None
        self._closing = threading.Event()
        self._aborting = threading.Event()
        self._lock = threading.Lock()
        self._receiving = False
        self._polls = 0
        self._notice: BackgroundCall[str | None] | None = None
        self._header_work: Any = None  # work of a header receive in progress
        self._held: tuple[int, int] | None = None  # (bucket, CRC word) of a header not posted
        self._in_place: list[Any] = []  # this round's receives into the sink's tensors
        self._late: list[Any] = []  # in-place receives of abandoned rounds (_settle_late)

    # ------------------------------------------------------------------ the hooks
    def check_init(self, init_info: InitT) -> None:
        """Refuse an init this worker cannot take (``PayloadError`` naming the field), before
        anything of the current channel is released."""

    @abstractmethod
    def open_channel(self, init_info: InitT) -> Channel:
        """Join this handshake's channel (blocking); call :meth:`check_stopped` between
        short waits, so an abort or a shutdown ends the wait."""

    # ------------------------------------------------------------------ init
    def init_transfer_engine(self, init_info: InitT) -> None:
        self.check_init(init_info)
        self._release()
        self._closing.clear()
        self._aborting.clear()
        channel = self.open_channel(init_info)
        with self._lock:
            self._channel, self._init = channel, init_info
            self._pool = BufferPool(
                init_info.packed_num_buffers, init_info.packed_buffer_size_bytes, self.device
            )

    def check_stopped(self) -> None:
        """Raise ``TransferError`` once this engine was shut down or aborted."""
        name = self.config.backend
        if self._closing.is_set():
            raise TransferError(f"{name} worker engine was shut down")
        if self._aborting.is_set():
            raise TransferError(
                f"{name} worker engine: aborted (a new init_weight_transfer_engine takes over)"
            )

    def _poll(self) -> None:
        """Between short waits: stop on shutdown or abort, or when the sender gave up.

        The sender's abort notice is read on a helper thread: a hung sender's store accepts
        the request and never answers, and that must not hold this thread (nor, through it,
        an abort or a shutdown).
        """
        self.check_stopped()
        self._polls += 1
        channel, notice = self._channel, self._notice
        if channel is None:
            return
        if notice is not None and notice.done():
            self._notice = None
            reason = notice.result(0) if notice.error is None else None
            if reason is not None:
                raise TransferError(f"the trainer abandoned the round: {reason}")
        elif notice is None and self._polls % _ABORT_CHECK_EVERY == 0:
            self._notice = BackgroundCall(
                channel.abort_reason, name=f"{self.config.backend}-abort-notice"
            )

    def _not_joined(self) -> ProtocolStateError:
        return ProtocolStateError(
            f"{self.config.backend} engine: init_transfer_engine was not called, or a failed "
            "round dropped the transfer group; call init_weight_transfer_engine again"
        )

    # ------------------------------------------------------------------ rounds
    def start_weight_update(self) -> None:
        if self._channel is None:
            raise self._not_joined()

    def receive_weights(self, update_info: UpdateT) -> None:
        with self._lock:
            channel, pool, info = self._channel, self._pool, self._init
            if channel is None or pool is None or info is None:
                raise self._not_joined()
            self._receiving = True
        try:
            self._receive(channel, pool, info, update_info)
        except BaseException as e:
            replacement = self._drop_after_failure(e)
            if replacement is not None:
                raise replacement from e
            raise
        finally:
            with self._lock:
                self._receiving = False
            if self._closing.is_set():
                self._release()

    def _receive(self, channel: Channel, pool: BufferPool, info: InitT, update: UpdateT) -> None:
        import torch

        # A notice asked for in an earlier round is about that round: one this receiver
        # finished while the sender failed on another (and then dropped the channel) answers
        # with its reason later, and must not fail this round.
        self._notice = None
        self._settle_late(info)
        buckets = _plan(update.metas, info)
        pool.prepare(buckets)
        self._held = None
        frames: list[_Frame | None] = [None] * len(buckets)
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        n, posted = len(buckets), 0
        in_place = 0  # bytes posted straight into the sink's tensors, not yet taken
        for i, bucket in enumerate(buckets):
            # Post receives ahead, in bucket order, as far as the pool allows (has_room).
            while posted < n and pool.has_room(posted - i, in_place):
                nxt = buckets[posted]
                if nxt.nbytes and not self._post(channel, info, pool, nxt, frames):
                    break  # its buffer still holds a bucket not yet loaded
                posted_frame = frames[posted]
                if posted_frame is not None and posted_frame.slot is None:
                    in_place += posted_frame.data.numel()
                posted += 1
            frame, frames[i] = frames[i], None
            if frame is None:  # nothing travels for an empty bucket
                self.sink.load_weights(list(unpack_bucket(bucket, empty)))
                continue
            if frame.slot is None:
                in_place -= frame.data.numel()
            wait_work(frame.work, what=frame.label, timeout_s=info.timeout_s, poll=self._poll)
            if frame.header is not None:  # posted with the bytes: checked once both are here
                wait_work(
                    frame.header_work,
                    what=f"header of {frame.label}",
                    timeout_s=info.timeout_s,
                    poll=self._poll,
                )
                frame.crc = check_header(
                    frame.header, index=bucket.index, nbytes=bucket.nbytes, what=frame.label
                )
            if frame.slot is None:
                # Received in place: the bytes already are in the sink's tensor. A CRC the
                # init info did not announce is still checked (a failed round publishes
                # nothing as consistent).
                check_crc(frame.data, frame.crc, what=frame.label)
                continue
            frame.slot.work = None
            check_crc(frame.data, frame.crc, what=frame.label)
            # The sink copies what it keeps (WeightSink contract), so the buffer is free after.
            self.sink.load_weights(list(unpack_bucket(bucket, frame.slot.buf)))
        self._in_place.clear()
        self._receive_header(channel, info, index=n, nbytes=0, what="the round's end header")

    def _receive_header(
        self, channel: Channel, info: InitT, *, index: int, nbytes: int, what: str
    ) -> int:
        """Receive the sender's next header and check it against the plan; its CRC word."""
        import torch

        header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
        # Kept where a failure path finds it: a channel is let go only once its work ended.
        self._header_work = work = channel.broadcast(header)
        wait_work(work, what=f"header of {what}", timeout_s=info.timeout_s, poll=self._poll)
        self._header_work = None
        return check_header(header, index=index, nbytes=nbytes, what=what)

    def _post(
        self,
        channel: Channel,
        info: InitT,
        pool: BufferPool,
        bucket: Bucket,
        frames: list[_Frame | None],
    ) -> bool:
        """Take ``bucket``'s header, then post the receive of exactly the planned bytes.

        A header that disagrees with the plan raises before the receive is posted, so the
        channel never sees a receive of the wrong size (gloo aborts the whole receiving
        process on a longer message, and leaves a stale tail on a shorter one). A bucket of
        one tensor whose header carries no CRC is received straight into the tensor the sink
        offers; others (and checksummed ones, verified before they are applied) into a
        buffer. Returns False, keeping the header, when that buffer is still busy.
        """
        i = bucket.index
        label = f"receive of bucket {bucket.index} ({bucket.nbytes} bytes)"
        if channel.checks_sizes:
            frame = self._post_with_header(channel, info, pool, bucket, label)
            frames[i] = frame
            return frame is not None
        if self._held is None or self._held[0] != i:
            crc = self._receive_header(
                channel, info, index=bucket.index, nbytes=bucket.nbytes, what=label
            )
            self._held = (i, crc)
        crc = self._held[1]
        landing = self._landing(pool, bucket, in_place=crc == NO_CRC)
        if landing is None:
            return False
        self._held = None
        frames[i] = self._post_receive(channel, *landing, label=label, crc=crc)
        return True

    def _landing(
        self, pool: BufferPool, bucket: Bucket, *, in_place: bool
    ) -> tuple[torch.Tensor, Slot | None] | None:
        """Where ``bucket``'s bytes land: the tensor the sink offers (a bucket of one tensor,
        ``in_place`` allowed), else its buffer; ``None`` while that buffer is still busy."""
        if in_place and len(bucket.metas) == 1:
            m = bucket.metas[0]
            dest = direct_destination(self.sink, m.name, m.dtype, m.shape, self.device)
            if dest is not None:
                return as_bytes(dest), None
        busy = pool.peek(bucket)
        if busy is not None and busy.work is not None:
            return None
        slot = pool.slot_for(bucket)
        return slot.view(bucket.nbytes), slot

    def _post_receive(
        self,
        channel: Channel,
        data: torch.Tensor,
        slot: Slot | None,
        *,
        label: str,
        crc: int,
        header: tuple[torch.Tensor, Any] | None = None,
    ) -> _Frame:
        """Post the receive into ``data``; remember its work where the failure path finds it.

        ``header``: the header posted just before, and its receive.
        """
        work = channel.broadcast(data)
        if slot is not None:
            slot.work, slot.label = work, label
        else:
            self._in_place.append(work)
        return _Frame(work, label, crc, data, slot, *(header or (None, None)))

    def _post_with_header(
        self, channel: Channel, info: InitT, pool: BufferPool, bucket: Bucket, label: str
    ) -> _Frame | None:
        """Post ``bucket``'s bytes, and before them its header when it carries a CRC.

        Only on a channel that refuses a message of another size by itself, before writing
        any of it, so no receive of the wrong size can land and the sender sends no header
        for sizes alone. A CRC header (the init info's ``checksum``) is posted with the bytes
        and checked once both came, and the bucket is staged for it. Not waiting between the
        two keeps the stream flowing: the next bytes are read while this thread is still
        loading the previous bucket. Returns ``None``, posting nothing, while the bucket's
        buffer is busy.
        """
        import torch

        landing = self._landing(pool, bucket, in_place=not info.checksum)
        if landing is None:
            return None
        header = None
        if info.checksum:
            buf = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
            header = (buf, channel.broadcast(buf))  # closing the channel ends it with the bytes
        return self._post_receive(channel, *landing, label=label, crc=NO_CRC, header=header)

    def _settle_late(self, info: InitT) -> None:
        """Wait until no receive of an abandoned round can still write into the sink.

        A receive posted in place cannot be cancelled (gloo lets it run until its bytes
        arrive, its peer closes, or the group's timeout); if a round is abandoned with one
        pending, its old sender may still deliver into the model. No new round writes into
        the sink before every such receive ended, so a late delivery never lands on top of a
        newer round that then reads as consistent. Usually they have long ended (a trainer
        that failed still sends what it had started, a killed one closes its connections).
        """
        self._late = [w for w in self._late if not w.is_completed()]
        while self._late:
            work = self._late[0]
            try:
                wait_work(
                    work,
                    what="an abandoned round's in-place receive (it may still write into "
                    "the model)",
                    timeout_s=info.timeout_s,
                    poll=self.check_stopped,
                )
            except TransferError:
                if not work.is_completed():
                    raise  # shut down, aborted or timed out: it stays on the list
            self._late.pop(0)

    def _drop_after_failure(self, error: BaseException) -> BaseException | None:
        """A half-received sequence cannot be resumed: drop the channel (never blocking).

        Returns a clearer error when the wire failed because the trainer gave up.
        """
        with self._lock:
            channel, self._channel = self._channel, None
            pending = self._pending()
            if self._pool is not None:
                self._pool.forget_work()
        replacement: BaseException | None = None
        self._notice = None
        stopped = self._closing.is_set() or self._aborting.is_set()
        if channel is not None and isinstance(error, TransferError) and not stopped:
            notice = BackgroundCall(
                channel.abort_reason, name=f"{self.config.backend}-abort-notice"
            )
            reason = notice.result(_NOTICE_WAIT_S) if notice.wait(_NOTICE_WAIT_S) else None
            if reason is not None and "abandoned" not in str(error):
                replacement = TransferError(f"the trainer abandoned the round: {reason}")
        if channel is not None:
            channel.release(pending)
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # drop frame refs to the channel's work
        return replacement

    # ------------------------------------------------------------------ teardown
    def _pending(self) -> list[Any]:
        """Receives that may still use the channel (and its buffers); takes them over.

        In-place receives among them are remembered (:meth:`_settle_late`).
        """
        pending = self._pool.pending() if self._pool is not None else []
        header, self._header_work = self._header_work, None
        in_place, self._in_place = self._in_place, []
        self._late += [w for w in in_place if not w.is_completed()]
        return [*pending, *in_place, *([header] if header is not None else [])]

    def _release(self) -> None:
        """Drop the channel and the buffers (a re-init may use other sizes)."""
        with self._lock:
            channel, self._channel = self._channel, None
            pending = self._pending()
            self._pool = None
        if channel is not None:
            channel.release(pending)

    def abort(self) -> None:
        """End a blocking init or receive within about 50 ms; a new init clears it.

        The call in progress raises ``TransferError`` and drops the channel (the trainer it
        was talking to is gone or hung); the engine is usable again after the next init.
        """
        self._aborting.set()
        with self._lock:
            if self._receiving:
                return  # the receiving thread sees the flag within 50 ms and drops the channel
        self._release()

    def shutdown(self) -> None:
        """Drop the channel; a receive in progress ends with an error. Idempotent."""
        self._closing.set()
        with self._lock:
            if self._receiving:
                return  # the receiving thread sees the flag within 50 ms and releases
        self._release()
