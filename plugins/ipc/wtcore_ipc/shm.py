"""POSIX shared-memory segments: the trainer's staging buffers and the worker's read-only maps.

Why not :class:`multiprocessing.shared_memory.SharedMemory`: on Python 3.10-3.12 it registers
even an *attached* segment with the resource tracker, which then unlinks it (and warns about a
"leak") when the attaching process exits, and a worker that unregisters again also removes the
trainer's own registration when both share one tracker. We open ``/dev/shm/<name>`` ourselves
with :func:`os.open` and :mod:`mmap` instead: no tracker, no hidden unlink, and full control of
the open flags. The trainer builds a segment as an unnamed ``O_TMPFILE`` in ``/dev/shm``, locks
it, reserves its pages (:func:`os.posix_fallocate`: a full ``/dev/shm`` is an error naming the
size, not a ``SIGBUS`` on first write) and only then links it under its name, so no segment is
ever visible unlocked, half-sized or unreserved. The worker opens with ``O_NOFOLLOW |
O_NONBLOCK`` (a FIFO cannot block it) and checks type, owner and size before mapping, and the
size again before every read (a segment truncated under the mapping would be a ``SIGBUS``).

Lifetime and liveness: the trainer takes an exclusive :func:`fcntl.flock` on its segment for as
long as it owns it. The kernel drops that lock when the trainer exits, however it exits
(SIGKILL included), so a worker can tell an *orphaned* segment from a live one without trusting
PIDs (which PID namespaces and PID reuse make unreliable): if it can take the lock, the owner is
gone, the contents are not to be trusted, and the worker unlinks the segment itself. The trainer
unlinks its segments at shutdown, on errors, and at interpreter exit (a :func:`weakref.finalize`,
which also runs at exit). A trainer killed before any worker saw its segment leaves it to
:func:`reclaim_orphans`, which every new segment and every worker init runs: it unlinks each
``wtcore_ipc_*`` segment of this user whose lock nobody holds.

Layout: a control area of :data:`CONTROL_BYTES` (one 64-byte acknowledgement entry per
receiver rank, the only bytes a worker writes), then ``num_slots`` slots, each a 64-byte header
followed by ``capacity`` data bytes. The header holds a magic tag, the sequence number of the
bucket the slot holds and its length; the trainer writes it after the data, the worker checks
it before and after copying, so a stale, replayed or forged slot is an error instead of
silently loading the wrong bytes. Every field either side reads from the segment is checked
before use: the other process is not trusted.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wtcore.buckets import ALIGNMENT, align
from wtcore.errors import PayloadError, TransferError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACK_BYTES",
    "CANCELLED",
    "CONTROL_BYTES",
    "HEADER_BYTES",
    "MAX_RECEIVERS",
    "SEGMENT_NAME_RE",
    "SHM_DIR",
    "Ack",
    "SegmentReader",
    "SlotHeader",
    "StagingSegment",
    "check_segment_name",
    "host_status",
    "reclaim_orphans",
    "segment_prefix",
    "trainer_of",
]

#: Where Linux exposes POSIX shared memory.
SHM_DIR = "/dev/shm"
#: Every name a payload may carry; no slash, so a payload cannot point at another file.
#: Matched with :meth:`re.Pattern.fullmatch` (``$`` alone would accept a trailing newline).
SEGMENT_NAME_RE = re.compile(r"wtcore_[A-Za-z0-9_]{1,200}")
#: Bytes of the header in front of each slot (one alignment unit keeps data aligned).
HEADER_BYTES = ALIGNMENT
#: One acknowledgement entry per receiver rank, each on its own cache line.
ACK_BYTES = 64
#: Receiver ranks one segment can serve (the control area is one page).
MAX_RECEIVERS = 64
CONTROL_BYTES = ACK_BYTES * MAX_RECEIVERS
_MAGIC = b"WTCIPC02"
# A slot header: magic (8 bytes), seq (u64, the commit word), length (u64), then padding.
# An acknowledgement entry: round token (the round's first seq), buckets consumed, world size.
_SEQ_AT = 8  # the header's commit word: written last by the trainer, read first by the worker
_LENGTH_AT = 16
#: A header ``length`` meaning "the trainer abandoned the round at this bucket".
CANCELLED = (1 << 64) - 1


def host_status() -> str:
    """One line for ``wtcore plugins``, shared by both halves of the engine."""
    shm = "shm ok" if os.path.isdir(SHM_DIR) else f"shm unavailable (no {SHM_DIR})"
    return f"{shm}; cuda ipc untested"


def segment_prefix(pid: int | None = None) -> str:
    """The name prefix of every segment created by process ``pid`` (default: this one)."""
    return f"wtcore_ipc_{os.getpid() if pid is None else pid}_"


def trainer_of(name: str) -> str:
    """Who created segment ``name``, for error messages (the PID its name carries, unverified)."""
    pid = name[len("wtcore_ipc_") :].split("_", 1)[0] if name.startswith("wtcore_ipc_") else ""
    return f"trainer pid {pid}" if pid.isdigit() and len(pid) < 12 else "its trainer"


def check_segment_name(name: object, *, field: str = "segment") -> str:
    if not isinstance(name, str) or not SEGMENT_NAME_RE.fullmatch(name):
        raise PayloadError(
            f"{field}: expected a segment name matching {SEGMENT_NAME_RE.pattern}, got {name!r}"
        )
    return name


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class _Words:
    """The mapping as 64-bit words: each read or write is ONE aligned 8-byte access.

    Not :mod:`struct`: ``pack_into`` zeroes the target before writing it, so a peer polling the
    word can read a transient 0 (a world size of 0, a sequence number gone back).
    """

    def __init__(self, mm: mmap.mmap) -> None:
        self._view: memoryview | None = memoryview(mm).cast("Q")

    def __getitem__(self, byte_offset: int) -> int:
        assert self._view is not None and byte_offset % 8 == 0
        return int(self._view[byte_offset // 8])

    def __setitem__(self, byte_offset: int, value: int) -> None:
        assert self._view is not None and byte_offset % 8 == 0
        self._view[byte_offset // 8] = value

    def release(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _open_checked(name: str, *, write: bool = False) -> tuple[int, os.stat_result]:
    """Open ``/dev/shm/<name>`` without following links or blocking on a FIFO, and check it is
    a non-empty regular file of this user before anything reads it."""
    path = _path(name)
    mode = os.O_RDWR if write else os.O_RDONLY
    try:
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PayloadError(
            f"segment: no shared-memory segment named {name!r} in {SHM_DIR} (it was "
            "unlinked, or the trainer runs on another host or in another /dev/shm)"
        ) from None
    except OSError as e:
        raise PayloadError(f"segment: cannot open {name!r}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PayloadError(f"segment: {name!r} is not a regular shared-memory file")
        if st.st_uid != os.geteuid():
            raise PayloadError(
                f"segment: {name!r} belongs to uid {st.st_uid}, not to this worker's uid "
                f"{os.geteuid()}"
            )
        if st.st_size <= 0:
            raise PayloadError(f"segment: {name!r} is empty")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _unlocked(fd: int) -> bool:
    """True when no process holds an exclusive lock on ``fd``'s file (its owner is gone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def reclaim_orphans() -> list[str]:
    """Unlink every ``wtcore_ipc_*`` segment of this user whose trainer is gone; their names.

    A trainer killed before any worker mapped its segment (before its first update arrived)
    leaves it behind, and no worker would ever look at it. The trainer's lock tells: a live
    trainer holds it, and the kernel drops it when the trainer dies, so nothing here depends
    on PIDs. Runs whenever a trainer creates a segment and whenever a worker inits.
    """
    reclaimed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    for name in names:
        if not name.startswith("wtcore_ipc_") or not SEGMENT_NAME_RE.fullmatch(name):
            continue
        try:
            fd, st = _open_checked(name)
        except PayloadError:
            continue  # gone meanwhile, not ours, not a segment: none of our business
        try:
            if _unlocked(fd):
                here = os.stat(_path(name), follow_symlinks=False)
                if (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
                    _unlink_quietly(_path(name))
                    reclaimed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return reclaimed


def _link_tmpfile(fd: int, path: str) -> None:
    """Give the ``O_TMPFILE`` behind ``fd`` the name ``path`` (``linkat`` through /proc).

    A relative source with ``src_dir_fd`` makes :func:`os.link` call ``linkat`` with
    ``AT_SYMLINK_FOLLOW``; plain ``link`` would not follow /proc's link to the open file.
    """
    procfd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=procfd, follow_symlinks=True)
    finally:
        os.close(procfd)


#: What a staging ring needs in ``/dev/shm``, and how to need less (for the "full" error).
RING_NEEDS = (
    "the ipc engine needs packed_num_buffers x (packed_buffer_size_bytes or the largest tensor)",
    " or lower packed_buffer_size_bytes / packed_num_buffers",
)


def _shm_full(size: int, e: OSError, needs: tuple[str, str]) -> TransferError:
    return TransferError(
        f"{SHM_DIR} has no room for a {size}-byte segment ({e.strerror}): {needs[0]} "
        f"in {SHM_DIR}. Give it more (Docker: `docker run --shm-size=<at least {size} bytes "
        "plus headroom>`; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm)"
        f"{needs[1]}"
    )


@dataclass(frozen=True)
class SlotHeader:
    magic: bytes
    seq: int
    length: int

    @property
    def valid(self) -> bool:
        return self.magic == _MAGIC

    @property
    def blank(self) -> bool:
        """Never written (a fresh segment is zeros)."""
        return self.magic == bytes(8) and self.seq == 0 and self.length == 0


@dataclass(frozen=True)
class Ack:
    """What receiver ``rank`` wrote in its control entry: how far it got in round ``token``."""

    token: int
    consumed: int
    world_size: int


class StagingSegment:
    """A trainer-owned segment of ``num_slots`` reusable staging buffers.

    Created once per engine (and again only when a bigger bucket needs more room), reused for
    every bucket of every round.
    """

    def __init__(
        self, capacity: int, num_slots: int, *, needs: tuple[str, str] = RING_NEEDS
    ) -> None:
        """``needs``: what the segment is for and how to shrink it, for a full ``/dev/shm``."""
        import torch

        if capacity < 0 or num_slots < 1:
            raise PayloadError(f"bad segment shape: capacity={capacity}, num_slots={num_slots}")
        self.capacity = align(max(capacity, 1))
        self.num_slots = num_slots
        self.stride = HEADER_BYTES + self.capacity
        self.size = CONTROL_BYTES + self.stride * num_slots
        self.name = f"{segment_prefix()}{secrets.token_hex(6)}"
        self.path = _path(self.name)
        reclaim_orphans()
        # Unnamed until it is locked and its pages are reserved: if anything below fails (or
        # the process dies), closing the fd frees it and nothing is left in /dev/shm.
        fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until close or process exit
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise _shm_full(self.size, e, needs) from None
                raise TransferError(f"{SHM_DIR}: reserving {self.size} bytes failed: {e}") from e
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.size)
            _link_tmpfile(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        # From here on the name exists: make sure it goes away whatever happens next.
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        self._fd: int | None = fd
        self._buf: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._words = _Words(self._mm)

    @property
    def closed(self) -> bool:
        return self._buf is None

    def data_offset(self, slot: int) -> int:
        return CONTROL_BYTES + slot * self.stride + HEADER_BYTES

    def slot(self, slot: int) -> torch.Tensor:
        """The data area of ``slot`` as a flat ``uint8`` tensor (``capacity`` bytes)."""
        if self._buf is None:
            raise TransferError(f"segment {self.name} is closed")
        off = self.data_offset(slot)
        return self._buf[off : off + self.capacity]

    def publish(self, slot: int, seq: int, length: int) -> None:
        """Stamp ``slot``'s header once its data is written; ``seq`` last (it commits)."""
        assert self._mm is not None
        at = self.data_offset(slot) - HEADER_BYTES
        self._mm[at : at + 8] = _MAGIC
        self._words[at + _LENGTH_AT] = length
        self._words[at + _SEQ_AT] = seq

    def cancel(self, slot: int, seq: int) -> None:
        """Tell workers waiting for bucket ``seq`` (in ``slot``) that the round is abandoned."""
        if self._mm is not None:
            self.publish(slot, seq, CANCELLED)

    def ack(self, rank: int) -> Ack:
        """Receiver ``rank``'s control entry, as written (untrusted: the caller checks it)."""
        assert self._mm is not None and 0 <= rank < MAX_RECEIVERS
        at = rank * ACK_BYTES
        token = self._words[at]  # first: the commit word
        return Ack(token, self._words[at + 8], self._words[at + 16])

    def close(self, *, unmap: bool = True) -> None:
        """Unlink and unmap. Idempotent; safe while a worker still maps the segment.

        ``unmap=False`` leaves the mapping to the garbage collector, for tensors that live on
        in it (shared weights): unmapping under them would crash the process on next use.
        """
        self._finalizer()  # unlink first: nothing new can attach
        self._buf = None
        self._words.release()
        if self._mm is not None and not unmap:
            self._mm = None  # torch.frombuffer's tensors hold the mmap object until they die
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view escaped; the GC unmaps it with the last view
                pass
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


class SegmentReader:
    """A worker's map of one trainer segment, kept across buckets and rounds.

    Shared and writable, because the worker acknowledges what it consumed in its entry of the
    control area; it writes nothing else.

    One lock covers every use of the descriptor and the mapping and :meth:`close`: a worker's
    init (or shutdown) may close the reader while an abandoned round's thread still reads
    from it, and a descriptor closed under a read could be reused by the next ``open`` of
    this process, so that read would copy another file's bytes. Under the lock a late
    reader finds the segment closed (a ``TransferError``) instead.
    """

    def __init__(self, name: str) -> None:
        import torch

        self.name = check_segment_name(name)
        fd, st = _open_checked(name, write=True)
        try:
            self.size = st.st_size
            if self.size < CONTROL_BYTES + HEADER_BYTES:
                raise PayloadError(
                    f"segment: {name!r} has {self.size} bytes, less than a control area and "
                    "one slot header"
                )
            if self.size % 8:
                raise PayloadError(f"segment: {name!r} has {self.size} bytes, not whole words")
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._buf: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._words = _Words(self._mm)
        self._lock = threading.RLock()

    def _open_fd(self) -> int:
        """The descriptor, under the lock; ``TransferError`` once closed."""
        if self._fd is None:
            raise TransferError(f"segment {self.name} is closed")
        return self._fd

    def owner_alive(self) -> bool:
        """False when no process holds the trainer's lock any more (an orphaned segment)."""
        with self._lock:
            return not _unlocked(self._open_fd())

    def check_size(self) -> None:
        """Refuse to touch the mapping if the file shrank under it (that read would SIGBUS).

        Called before every read: the mapping outlives the size check made at open.
        """
        with self._lock:
            now = os.fstat(self._open_fd()).st_size
        if now < self.size:
            raise TransferError(
                f"segment {self.name!r}: truncated to {now} bytes while mapped ({self.size} "
                "bytes at open); refusing to read it (the trainer must stage the round again)"
            )

    def ack(self, rank: int, token: int, consumed: int, world_size: int) -> None:
        """Tell the trainer this rank has consumed ``consumed`` buckets of round ``token``."""
        assert 0 <= rank < MAX_RECEIVERS
        with self._lock:
            self.check_size()
            at = rank * ACK_BYTES
            self._words[at + 16] = world_size
            self._words[at + 8] = consumed
            self._words[at] = token  # last: the entry's commit word

    def header(self, data_offset: int) -> SlotHeader:
        """The slot's header, commit word first (see :meth:`StagingSegment.publish`)."""
        with self._lock:
            self.check_size()
            assert self._mm is not None
            at = data_offset - HEADER_BYTES
            seq = self._words[at + _SEQ_AT]
            return SlotHeader(bytes(self._mm[at : at + 8]), seq, self._words[at + _LENGTH_AT])

    def view(self, offset: int, length: int) -> torch.Tensor:
        if self._buf is None:
            raise TransferError(f"segment {self.name} is closed")
        self.check_size()
        return self._buf[offset : offset + length]

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Copy ``out.numel()`` bytes at ``offset`` into the flat ``uint8`` CPU tensor ``out``.

        Through the file descriptor (``os.preadv``), not the mapping: a peer that truncates the
        file meanwhile makes the read come back short, which is refused here, where a read
        through the mapping would kill this process with SIGBUS. The copy is the kernel's, one
        per byte, as the mapping's would be.
        """
        want = out.numel()
        if offset < 0 or offset + want > self.size:
            raise PayloadError(
                f"segment {self.name!r}: {want} bytes at {offset} end past its {self.size} bytes"
            )
        done = 0
        view = memoryview(out.numpy()).cast("B") if want else memoryview(b"")  # type: ignore[arg-type]
        with self._lock:
            fd = self._open_fd()
            while done < want:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    now = os.fstat(fd).st_size
                    raise TransferError(
                        f"segment {self.name!r}: truncated to {now} bytes while {want} bytes "
                        f"at {offset} were read out of it ({self.size} bytes at open); the "
                        "round is refused (the trainer must stage it again)"
                    )
                done += got

    def unlink_orphan(self) -> None:
        """Unlink the segment if its owner is gone (the trainer was killed)."""
        with self._lock:
            if self._fd is not None and not self.owner_alive():
                _unlink_quietly(_path(self.name))

    def close(self) -> None:
        """Unmap and close; idempotent, and never under a read of another thread."""
        with self._lock:
            self._buf = None
            self._words.release()
            if self._mm is not None:
                try:
                    self._mm.close()
                except BufferError:  # a sink kept a view; the GC unmaps it with the last one
                    pass
                self._mm = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
