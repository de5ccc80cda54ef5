"""What streamed data planes share: a channel, its in-flight work, reused buffers, bounded waits.

A transfer holds at most ``buffer size x num_buffers + largest tensor``; buffers live as long
as the engine (writing into fresh memory is much slower on small hosts). Each buffer remembers
the message that last used it, and the next bucket that wants it waits for that message:
that bounds the staged buckets in flight. In-place messages hold no buffer, so
:meth:`BufferPool.has_room` lets more of them fly (docs/architecture.md).
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
    """One handshake's data plane, as one rank sees it: rank 0 sends, the others receive;
    every rank calls :meth:`broadcast` for the same messages in the same order."""

    @property
    def checks_sizes(self) -> bool:
        """Whether the channel refuses a message of another size than the receive posted,
        before writing any of it; then a receive may be posted before its frame header was
        checked (a stream does; gloo aborts the process instead)."""
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
    ``torch.distributed`` ``Work``."""

    label: str
    recvs_left: int
    sends_left: int
    send_peer: int | None = None
    recv_peer: int | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _fail(self, message: str, *, receiving: bool = False) -> None:
        """Fail with ``message``. ``receiving``: the caller is not the receiving thread, so
        the work ends only once the receive is done, never while bytes may still land."""
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
    """Wait for ``work`` at most ``timeout_s``, running ``poll`` (it raises to give up) every
    50 ms; a work that completed is never reported as failed, however close to an expiry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            work.wait(_POLL_TD)
            return
        except RuntimeError:
            # Our short wait expired or the work failed: a completed work's wait says which.
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
    buf: torch.Tensor
    work: Work | None = None
    label: str = ""

    def view(self, nbytes: int) -> torch.Tensor:
        return self.buf[:nbytes]


@dataclass
class BufferPool:
    """``num_buffers`` ring buffers plus one oversize buffer, allocated on first use, kept."""

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
        """The next staged bucket's buffer; grown at most once a round, at its first use."""
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
        assert self.last is not None
        return self.last

    def _slots(self) -> list[Slot]:
        return [*self.ring, *([self.large] if self.large is not None else [])]

    def pending(self) -> list[Work]:
        return [s.work for s in self._slots() if s.work is not None]

    def forget_work(self) -> None:
        for s in self._slots():
            s.work = None
        self.last = None

    def nbytes(self) -> int:
        return sum(s.buf.numel() for s in self._slots())

    def has_room(self, in_flight: int, in_place_bytes: int) -> bool:
        """Whether one more message may go in flight behind ``in_flight``: always
        ``num_buffers`` of them, beyond that while ``in_place_bytes`` (a sharded source's
        gathered tensors) and this pool stay under ``num_buffers x buffer_size``."""
        budget = self.num_buffers * self.buffer_size
        return in_flight < self.num_buffers or in_place_bytes + self.nbytes() < budget
