"""The receiver of a streamed engine: receives posted ahead, frames checked before they land.

Receives are posted ahead, into reused buffers or in place into the sink's tensors, so the
next buckets are on the wire while the sink copies the current one. A receive of an abandoned
round, which cannot be cancelled, is settled before the next round writes (docs/nccl.md).
"""

from __future__ import annotations

import threading
import traceback
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from wtcore.buckets import Bucket, as_bytes, unpack_bucket
from wtcore.engine import WeightTransferEngine
from wtcore.errors import PayloadError, ProtocolStateError, TransferError
from wtcore.sink import direct_destination
from wtcore_channel.frames import HEADER_WORDS, NO_CRC, check_crc, check_header
from wtcore_channel.options import ChannelSettings, ChannelUpdateInfo, plan
from wtcore_channel.parts import bucket_parts, new_pad, parts_of
from wtcore_channel.pipeline import BufferPool, Channel, Slot, wait_work
from wtcore_kit.concurrency import BackgroundCall

if TYPE_CHECKING:
    import torch

__all__ = ["ChannelWorkerEngine"]

_NOTICE_WAIT_S = 1.0  # after a failed receive: the sender's reason is a clearer error
_ABORT_CHECK_EVERY = 4  # polls of 50 ms between asking whether the sender gave up

InitT = TypeVar("InitT", bound=ChannelSettings)
UpdateT = TypeVar("UpdateT", bound=ChannelUpdateInfo)


@dataclass
class _Frame:
    """One posted receive. ``header``: one posted with the bytes, still to be checked."""

    work: Any
    label: str
    crc: int
    data: torch.Tensor | list[torch.Tensor]  # a list: received in parts (PartsChannel)
    slot: Slot | None  # None: received in place, into the sink's tensor(s)
    header: torch.Tensor | None = None
    header_work: Any = None
    # Tensors of a bucket in parts with no place offered: loaded once they came.
    staged: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class ChannelWorkerEngine(WeightTransferEngine[InitT, UpdateT], Generic[InitT, UpdateT]):
    """Worker half of a streamed engine: the engine implements :meth:`open_channel`.

    Every wait is bounded and polls for a shutdown, an abort and the sender's abort notice.
    After a failed round the channel is dropped until the next init handshake.
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
        self._pad: torch.Tensor | None = None  # where alignment gaps land (parts.bucket_parts)

    # ------------------------------------------------------------------ the hooks
    def check_init(self, init_info: InitT) -> None:
        """Refuse an init this worker cannot take, before anything is released; engines
        extend it (call ``super()``)."""
        rank = init_info.rank_offset + self.rank
        if rank >= init_info.world_size:
            raise PayloadError(
                f"init_info.world_size: {init_info.world_size} is too small: worker rank "
                f"{self.rank} at rank_offset {init_info.rank_offset} would be rank {rank}"
            )

    @abstractmethod
    def open_channel(self, init_info: InitT) -> Channel:
        """Join this handshake's channel; call :meth:`check_stopped` between short waits."""

    @property
    def channel_device(self) -> str:
        """Where the channel's buffers live and what it may receive into in place."""
        return str(self.device)

    # ------------------------------------------------------------------ init
    def init_transfer_engine(self, init_info: InitT) -> None:
        self.check_init(init_info)
        self._release()
        self._closing.clear()
        self._aborting.clear()
        channel = self.open_channel(init_info)
        with self._lock:
            self._channel, self._init = channel, init_info
            num, size = init_info.packed_num_buffers, init_info.packed_buffer_size_bytes
            self._pool = BufferPool(num, size, self.channel_device)

    def check_stopped(self) -> None:
        name = self.config.backend
        if self._closing.is_set():
            raise TransferError(f"{name} worker engine was shut down")
        if self._aborting.is_set():
            raise TransferError(
                f"{name} worker engine: aborted (a new init_weight_transfer_engine takes over)"
            )

    def _poll(self) -> None:
        """Between short waits: stop on shutdown or abort, or when the sender gave up (read on
        a helper thread: a hung sender's store never answers)."""
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
    def receives_after_return(self, update_info: UpdateT) -> bool:
        return True  # the sender's stream waits for this receiver

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

        # A notice asked for in an earlier round is about that round, not this one.
        self._notice = None
        self._settle_late(info)
        buckets = plan(update.metas, info)
        pool.prepare(buckets)
        self._held = None
        frames: list[_Frame | None] = [None] * len(buckets)
        empty = torch.empty(0, dtype=torch.uint8, device=self.channel_device)
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
                    in_place += nxt.nbytes
                posted += 1
            frame, frames[i] = frames[i], None
            if frame is None:  # nothing travels for an empty bucket
                self.sink.load_weights(list(unpack_bucket(bucket, empty)))
                continue
            if frame.slot is None:
                in_place -= bucket.nbytes
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
            if isinstance(frame.data, list):  # in parts: never with a CRC (see _landing)
                if frame.staged:
                    self.sink.load_weights(frame.staged)
                continue
            if frame.slot is None:  # in place; a CRC not announced at init is still checked
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
        import torch

        header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.channel_device)
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
        """Take ``bucket``'s header, then post the receive of exactly the planned bytes (a
        bad header raises first). False, keeping the header, while the buffer is busy."""
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
        landing = self._landing(channel, pool, bucket, in_place=crc == NO_CRC)
        if landing is None:
            return False
        self._held = None
        frames[i] = self._post_receive(channel, landing, label=label, crc=crc)
        return True

    def _landing(
        self, channel: Channel, pool: BufferPool, bucket: Bucket, *, in_place: bool
    ) -> _Frame | None:
        """Where ``bucket``'s bytes land: the sink's tensor(s) (``in_place``), else its buffer;
        ``None`` while that buffer is busy."""
        if in_place and (len(bucket.metas) == 1 or parts_of(channel) is not None):
            frame = self._in_place_landing(bucket)
            if frame is not None:
                return frame
        busy = pool.peek(bucket)
        if busy is not None and busy.work is not None:
            return None
        slot = pool.slot_for(bucket)
        return _Frame(None, "", NO_CRC, slot.view(bucket.nbytes), slot)

    def _in_place_landing(self, bucket: Bucket) -> _Frame | None:
        """The sink's tensors for ``bucket``; ``None`` when it offers none for its first. A
        later one with no place is received into fresh memory: the offers made were already
        counted as landed (``wtcore.ledger``), so the bucket cannot go back to its buffer."""
        import torch

        device = self.channel_device
        first, *rest = bucket.metas
        dest = direct_destination(self.sink, first.name, first.dtype, first.shape, device)
        if dest is None:
            return None
        if not rest:
            return _Frame(None, "", NO_CRC, as_bytes(dest), None)
        if self._pad is None:
            self._pad = new_pad(device)
        frame = _Frame(None, "", NO_CRC, [], None)
        tensors = [dest]
        for m in rest:
            t = direct_destination(self.sink, m.name, m.dtype, m.shape, device)
            if t is None:
                t = torch.empty(m.shape, dtype=m.dtype, device=device)
                frame.staged.append((m.name, t))
            tensors.append(t)
        frame.data = bucket_parts(bucket, tensors, self._pad)
        return frame

    def _post_receive(
        self,
        channel: Channel,
        frame: _Frame,
        *,
        label: str,
        crc: int,
        header: tuple[torch.Tensor, Any] | None = None,
    ) -> _Frame:
        """Post the receive of ``frame``, its work kept where the failure path finds it."""
        if isinstance(frame.data, list):
            parts = parts_of(channel)
            assert parts is not None  # _landing lists parts only for such a channel
            frame.work = parts.broadcast_parts(frame.data)
        else:
            frame.work = channel.broadcast(frame.data)
        if frame.slot is not None:
            frame.slot.work, frame.slot.label = frame.work, label
        else:
            self._in_place.append(frame.work)
        frame.label, frame.crc = label, crc
        frame.header, frame.header_work = header or (None, None)
        return frame

    def _post_with_header(
        self, channel: Channel, info: InitT, pool: BufferPool, bucket: Bucket, label: str
    ) -> _Frame | None:
        """On a channel that checks sizes: post the bytes, with a CRC header before them
        (checked once both came, so the stream keeps flowing); ``None`` while the buffer is busy."""
        import torch

        landing = self._landing(channel, pool, bucket, in_place=not info.checksum)
        if landing is None:
            return None
        header = None
        if info.checksum:
            buf = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.channel_device)
            header = (buf, channel.broadcast(buf))  # closing the channel ends it with the bytes
        return self._post_receive(channel, landing, label=label, crc=NO_CRC, header=header)

    def _settle_late(self, info: InitT) -> None:
        """Wait until no in-place receive of an abandoned round (it cannot be cancelled) can
        still write into the sink, under a newer round that would then read as consistent."""
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
        """Drop the channel (a half-received sequence cannot be resumed), never blocking; a
        clearer error when the wire failed because the trainer gave up."""
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
                # Both: this rank's own failure names the peer it saw (maybe a relay).
                replacement = TransferError(
                    f"the trainer abandoned the round: {reason} (on this rank: {error})"
                )
        if channel is not None:
            channel.release(pending)
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)  # drop frame refs to the channel's work
        return replacement

    # ------------------------------------------------------------------ teardown
    def _pending(self) -> list[Any]:
        """Take over the receives that may still use the channel (in-place ones: _settle_late)."""
        pending = self._pool.pending() if self._pool is not None else []
        header, self._header_work = self._header_work, None
        in_place, self._in_place = self._in_place, []
        self._late += [w for w in in_place if not w.is_completed()]
        return [*pending, *in_place, *([header] if header is not None else [])]

    def _release(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
            pending = self._pending()
            self._pool = None
        if channel is not None:
            channel.release(pending)

    def abort(self) -> None:
        """End a blocking init or receive within about 50 ms; a new init clears it."""
        self._aborting.set()
        with self._lock:
            if self._receiving:
                return  # the receiving thread sees the flag within 50 ms and drops the channel
        self._release()

    def shutdown(self) -> None:
        self._closing.set()
        with self._lock:
            if self._receiving:
                return  # the receiving thread sees the flag within 50 ms and releases
        self._release()
