"""What streamed data planes share: a channel, its in-flight work, reused buffers, bounded waits.

An engine of the streamed kind (:mod:`wtcore_channel`: nccl over a process group, tcp over its
own streams) moves a round as a sequence of messages on a :class:`Channel`, each started by
:meth:`Channel.broadcast` and finished asynchronously, so the next bucket is packed (or the
next receive posted) while earlier ones are on the wire. This module holds the pieces every
such data plane needs: the :class:`Work` a message returns (``torch.distributed``'s own, or a
:class:`ThreadWork` driven by the data plane's threads), :func:`wait_work`, and the
:class:`BufferPool`.

Both ends keep ``packed_num_buffers`` ring buffers for regular buckets plus one buffer for
buckets larger than the buffer size (a tensor bigger than the buffer travels alone), so the
memory a transfer holds is at most ``buffer size x num_buffers + largest tensor``. Buffers
live as long as the engine: writing into fresh memory is much slower than into reused memory
on small hosts (docs/benchmarks.md).

Each buffer remembers the message that last used it; the next bucket that wants it waits
for that message first, which is what bounds the number of staged buckets in flight.
Messages that travel in place (a tensor sent from the source, received into the sink's
tensor) hold no buffer, so :meth:`BufferPool.has_room` lets more of them go in flight, up to
the bytes the ring could hold: with at most ``num_buffers`` in flight, a round of a few
hundred such tensors stopped the wire at every message until this thread came round.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from wtcore.buckets import Bucket
from wtcore.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool", "Channel", "Slot", "ThreadWork", "Work", "wait_work"]

_POLL_TD = datetime.timedelta(milliseconds=50)


class Work(Protocol):
    """One message in flight: ``torch.distributed``'s ``Work`` or a :class:`ThreadWork`."""

    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...


class Channel(Protocol):
    """One handshake's data plane, as one rank sees it: rank 0 sends, the others receive.

    Every rank calls :meth:`broadcast` for the same messages in the same order (the frame
    headers and buckets of :mod:`wtcore_channel`); the sender's call sends, a receiver's
    posts the receive into the given tensor.
    """

    @property
    def checks_sizes(self) -> bool:
        """Whether the channel itself refuses a message of another size than the receive
        posted for it, before writing any of it; then a receive may be posted before its
        frame header was checked (a stream does; gloo aborts the process instead)."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> Work:
        """Start sending ``tensor`` (rank 0) or receiving into it (the others)."""
        ...

    def set_abort(self, reason: str) -> None:
        """Tell the other ranks, best effort, that the sender abandoned the round."""
        ...

    def abort_reason(self) -> str | None:
        """The sender's abort reason, if it left one where this rank can read it."""
        ...

    def release(self, pending: Iterable[Work] = ()) -> None:
        """Close the channel without blocking; ``pending`` may still use it (let them end)."""
        ...


@dataclass
class ThreadWork:
    """A message whose sends and receives a data plane's own threads drive; quacks like a
    ``torch.distributed`` ``Work`` for :func:`wait_work` and the failure paths.

    Completed when every receive arrived and every send was taken, failed with the data
    plane's message (naming the peer) when one of them failed.
    """

    label: str
    recvs_left: int
    sends_left: int
    send_peer: int | None = None
    recv_peer: int | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _fail(self, message: str, *, receiving: bool = False) -> None:
        """Fail with ``message``. ``receiving``: the caller is not the receiving thread, which
        may still write into the buffer; the work then ends only once the receive is done
        with it (a relay whose onward send failed), never while bytes may still land."""
        with self._lock:
            if self.error is None:
                self.error = message
            wait_for_receive = receiving and self.recvs_left > 0
        if not wait_for_receive:
            self.done.set()

    def _count(self, *, recvs: int = 0, sends: int = 0) -> None:
        with self._lock:
            self.recvs_left -= recvs
            self.sends_left -= sends
            finished = self.recvs_left == 0 and (self.sends_left == 0 or self.error is not None)
        if finished:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Like ``Work.wait``: ``TransferError`` (a ``RuntimeError``) on failure or expiry."""
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise TransferError(f"{self.label}: still in flight ({self.pending_detail()})")
        if self.error is not None:
            raise TransferError(self.error)
        return True

    def pending_detail(self) -> str:
        """What this work still waits for, naming the peer (for timeout messages)."""
        if self.error is not None:
            return self.error
        if self.recvs_left:
            return f"{self.recvs_left} part(s) not yet received from rank {self.recv_peer}"
        return f"{self.sends_left} part(s) not yet taken by rank {self.send_peer}"


def wait_work(
    work: Work,
    *,
    what: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> None:
    """Wait for ``work`` at most ``timeout_s``, running ``poll`` every 50 ms while waiting.

    The wait itself happens in C++ (``Work.wait`` with a short timeout, without the GIL), so
    it wakes as soon as the work completes; ``poll`` raises to give up early (a rejected RPC,
    a shutdown). A short wait that expires leaves the work running (gloo only reports it),
    and a work that completed successfully is never reported as failed, however close its
    completion falls to an expiry.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            work.wait(_POLL_TD)
            return
        except RuntimeError:
            # Either our short wait expired or the work failed. A work that completes right
            # after the expiry reads as completed here too, so ask the work itself: waiting on
            # a completed work returns, or raises its own error if it failed.
            if work.is_completed():
                try:
                    work.wait()
                except RuntimeError as e:
                    raise TransferError(f"{what} failed: {e}") from e
                return
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            detail = getattr(work, "pending_detail", None)  # a forwarding chain names its peer
            more = f": {detail()}" if callable(detail) else ""
            raise TransferTimeoutError(f"{what} did not complete within {timeout_s:g} s{more}")


@dataclass
class Slot:
    """One reusable buffer and the broadcast that last used it."""

    buf: torch.Tensor
    work: Work | None = None
    label: str = ""

    def view(self, nbytes: int) -> torch.Tensor:
        return self.buf[:nbytes]


@dataclass
class BufferPool:
    """``num_buffers`` ring buffers plus one oversize buffer, allocated on first use, kept.

    Buffers are allocated only when a bucket is staged in them, so a round whose buckets all
    travel in place (see :mod:`wtcore_channel`) holds none.
    """

    num_buffers: int
    buffer_size: int
    device: str = "cpu"
    ring: list[Slot] = field(default_factory=list)
    large: Slot | None = None
    last: Slot | None = None
    _next: int = 0
    _regular: int = 0
    _oversize: int = 0

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        """Size this round's buffers (allocated, or grown, when first used)."""
        self._regular = max((b.nbytes for b in buckets if b.nbytes <= self.buffer_size), default=0)
        self._oversize = max((b.nbytes for b in buckets if b.nbytes > self.buffer_size), default=0)
        self._next = 0

    def _alloc(self, nbytes: int) -> Slot:
        import torch

        return Slot(torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    def peek(self, bucket: Bucket) -> Slot | None:
        """The slot :meth:`slot_for` would hand out next (``None``: not allocated yet)."""
        if bucket.nbytes > self.buffer_size:
            return self.large
        return self.ring[self._next % len(self.ring)] if self.ring else None

    def slot_for(self, bucket: Bucket) -> Slot:
        """The buffer the next staged bucket uses (staged buckets are asked for in order).

        Grows a buffer at most once a round (to the size :meth:`prepare` computed), and only
        at its first use in the round, when none of its work is pending.
        """
        if bucket.nbytes > self.buffer_size:
            if self.large is None or self.large.buf.numel() < bucket.nbytes:
                self.large = self._alloc(max(self._oversize, bucket.nbytes))
            slot = self.large
        else:
            if not self.ring or self.ring[0].buf.numel() < bucket.nbytes:
                size = max(self._regular, bucket.nbytes)
                self.ring = [self._alloc(size) for _ in range(self.num_buffers)]
            slot = self.ring[self._next % len(self.ring)]
            self._next += 1
        self.last = slot
        return slot

    def slot_for_last(self) -> Slot:
        """The slot handed out by the latest :meth:`slot_for`."""
        assert self.last is not None
        return self.last

    def _slots(self) -> list[Slot]:
        return [*self.ring, *([self.large] if self.large is not None else [])]

    def busy_slots(self) -> list[Slot]:
        """Slots whose last broadcast may still be running."""
        return [s for s in self._slots() if s.work is not None]

    def pending(self) -> list[Work]:
        """Broadcasts that may still use a buffer."""
        return [s.work for s in self._slots() if s.work is not None]

    def forget_work(self) -> None:
        for s in self._slots():
            s.work = None
        self.last = None

    def nbytes(self) -> int:
        """Bytes held by the pool (for memory accounting)."""
        return sum(s.buf.numel() for s in self._slots())

    def has_room(self, in_flight: int, in_place_bytes: int) -> bool:
        """Whether one more message may go in flight (or be posted) behind ``in_flight``.

        Always ``num_buffers`` of them; beyond that while the bytes held for messages in
        flight in place (``in_place_bytes``: a sharded source's gathered tensors) and by this
        pool stay under ``num_buffers x buffer_size``, so a transfer still holds at most that
        plus the largest tensor. A staged bucket also waits for its buffer (:meth:`slot_for`).
        """
        budget = self.num_buffers * self.buffer_size
        return in_flight < self.num_buffers or in_place_bytes + self.nbytes() < budget
