"""Shared-memory segments as sealed memfds: the trainer's staging buffers, the workers' maps.

The seals make reading through a mapping safe (a sealed file cannot shrink under it, so no
SIGBUS); the trainer's ``flock`` tells a worker whether its owner lives. How a worker finds
and checks a segment, and why: docs/ipc.md. Layout: a control area of :data:`CONTROL_BYTES`
(one 64-byte acknowledgement entry per receiver rank, the only bytes a worker writes), then
``num_slots`` slots, each a 64-byte header (magic, seq, length) and ``capacity`` data bytes.
Everything either side reads from the segment is checked: only its size is guaranteed.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.buckets import ALIGNMENT, align
from wtcore.errors import PayloadError, TransferError
from wtcore_kit.concurrency import BackgroundCall

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACK_BYTES",
    "CANCELLED",
    "CONTROL_BYTES",
    "GAVE_UP",
    "HEADER_BYTES",
    "MAX_FD",
    "MAX_RECEIVERS",
    "SEALS",
    "SEGMENT_NAME_RE",
    "SHM_DIR",
    "Ack",
    "SegmentReader",
    "SlotHeader",
    "StagingSegment",
    "check_segment_fd",
    "check_segment_name",
    "host_status",
    "segment_pid",
    "segment_prefix",
    "trainer_of",
]

#: POSIX shared memory; only the bench's ``shm_copy`` limit still uses it.
SHM_DIR = "/dev/shm"
#: Every segment name a payload may carry (no slash: it can only be compared, never point
#: anywhere). Use :meth:`re.Pattern.fullmatch`: ``$`` would accept a trailing newline.
SEGMENT_NAME_RE = re.compile(r"wtcore_ipc_(?P<pid>[1-9][0-9]{0,6})_(?P<token>[0-9a-f]{16})")
#: Linux's largest pid (``PID_MAX_LIMIT``); a name claiming a bigger one is forged.
_PID_MAX = 1 << 22
MAX_FD = (1 << 31) - 1
#: The seals every segment carries before any worker can learn of it.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: ``MFD_NOEXEC_SEAL`` (Linux 6.3): data, never code; older kernels refuse the flag.
_MFD_NOEXEC_SEAL = 0x0008
#: ``MADV_POPULATE_READ`` (Linux 5.14): map every page up front, so that no round faults.
_MADV_POPULATE_READ = 22
HEADER_BYTES = ALIGNMENT  # keeps each slot's data aligned
ACK_BYTES = 64  # one cache line per receiver rank
MAX_RECEIVERS = 64  # the control area is one page
CONTROL_BYTES = ACK_BYTES * MAX_RECEIVERS
_MAGIC = b"WTCIPC02"
# A slot header: magic (8 bytes), seq (u64, the commit word), length (u64), then padding.
# An acknowledgement entry: round token (the round's first seq), buckets consumed, world size.
_SEQ_AT = 8  # the header's commit word: written last by the trainer, read first by the worker
_LENGTH_AT = 16
#: A header ``length`` meaning "the trainer abandoned the round at this bucket".
CANCELLED = (1 << 64) - 1
#: An acknowledgement's ``consumed`` meaning "this worker gave up the round".
GAVE_UP = CANCELLED
_PROC_FD = "/proc/{pid}/fd/{fd}"
_LINK = "/memfd:{name} (deleted)"


def host_status() -> str:
    """One line for ``wtcore plugins``."""
    memfd = "sealed memfd ok" if _memfd_supported() else "sealed memfd unavailable (not Linux?)"
    return f"{memfd}; cuda ipc untested"


def _memfd_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc")


def segment_prefix(pid: int | None = None) -> str:
    return f"wtcore_ipc_{os.getpid() if pid is None else pid}_"


def trainer_of(name: str) -> str:
    """Who created segment ``name``, for error messages (the PID its name carries, unverified)."""
    pid = name[len("wtcore_ipc_") :].split("_", 1)[0] if name.startswith("wtcore_ipc_") else ""
    return f"trainer pid {pid}" if pid.isdigit() and len(pid) < 12 else "its trainer"


def check_segment_name(name: object, *, field: str = "segment") -> str:
    if (
        not isinstance(name, str)
        or not (m := SEGMENT_NAME_RE.fullmatch(name))
        or int(m["pid"]) > _PID_MAX
    ):
        raise PayloadError(
            f"{field}: expected a segment name matching {SEGMENT_NAME_RE.pattern} (a pid up "
            f"to {_PID_MAX}), got {name!r}"
        )
    return name


def check_segment_fd(fd: object, *, field: str = "segment_fd") -> int:
    if not isinstance(fd, int) or isinstance(fd, bool) or not 0 <= fd <= MAX_FD:
        raise PayloadError(f"{field}: expected a descriptor number in 0..{MAX_FD}, got {fd!r}")
    return fd


def segment_pid(name: str) -> int:
    m = SEGMENT_NAME_RE.fullmatch(check_segment_name(name))
    assert m is not None
    return int(m["pid"])


class _Words:
    """The mapping as 64-bit words: each access is ONE aligned 8-byte access (``struct``'s
    ``pack_into`` zeroes the target first, so a polling peer could read a transient 0)."""

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


def _rank_lock(fd: int, command: int, kind: int, rank: int) -> int:
    """An open-file-description lock on byte ``rank`` of ``fd``'s file (the kernel drops it
    with the last descriptor, so when its process dies): ``fcntl(command)``'s lock type back."""
    flock = struct.pack("hhqqi4x", kind, os.SEEK_SET, rank, 1, 0)  # struct flock, 64-bit
    return int(struct.unpack("hhqqi4x", fcntl.fcntl(fd, command, flock))[0])


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(name, flags | _MFD_NOEXEC_SEAL)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: a kernel before 6.3, without the flag
            raise
    return os.memfd_create(name, flags)


RING_NEEDS = (
    "the ipc engine needs packed_num_buffers x (packed_buffer_size_bytes or the largest tensor)",
    " or lower packed_buffer_size_bytes / packed_num_buffers",
)


def _shm_full(size: int, e: OSError, needs: tuple[str, str]) -> TransferError:
    return TransferError(
        f"the kernel refused to reserve a {size}-byte shared-memory segment ({e.strerror}): "
        f"{needs[0]}. Segments are memfds: they count against the process's memory (a "
        "container's or cgroup's memory limit, RLIMIT_FSIZE), not against /dev/shm; raise the "
        f"limit{needs[1]}"
    )


def _populate(mm: mmap.mmap) -> None:
    """Fault every page in now, so that no copy faults later (a kernel before 5.14 cannot)."""
    try:
        mm.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError, AttributeError):
        pass


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
        return self.magic == bytes(8) and self.seq == 0 and self.length == 0


@dataclass(frozen=True)
class Ack:
    token: int
    consumed: int
    world_size: int


class StagingSegment:
    """A trainer-owned sealed memfd of ``num_slots`` staging slots, reused every round."""

    def __init__(
        self, capacity: int, num_slots: int, *, needs: tuple[str, str] = RING_NEEDS
    ) -> None:
        import torch

        if capacity < 0 or num_slots < 1:
            raise PayloadError(f"bad segment shape: capacity={capacity}, num_slots={num_slots}")
        self.capacity = align(max(capacity, 1))
        self.num_slots = num_slots
        self.stride = HEADER_BYTES + self.capacity
        self.size = CONTROL_BYTES + self.stride * num_slots
        self.name = f"{segment_prefix()}{secrets.token_hex(8)}"
        # Locked, reserved and sealed before its number is announced to any worker.
        fd = _memfd(self.name)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until close or process exit
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise _shm_full(self.size, e, needs) from None
                raise TransferError(f"memfd: reserving {self.size} bytes failed: {e}") from e
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self._finalizer = weakref.finalize(self, _close_quietly, fd)
        self._fd: int | None = fd
        self.path = _PROC_FD.format(pid=os.getpid(), fd=fd)
        self._buf: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._words = _Words(self._mm)

    @property
    def fd(self) -> int | None:
        """``segment_fd``; ``None`` once closed."""
        return self._fd

    @property
    def closed(self) -> bool:
        return self._buf is None

    def data_offset(self, slot: int) -> int:
        return CONTROL_BYTES + slot * self.stride + HEADER_BYTES

    def slot(self, slot: int) -> torch.Tensor:
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

    def reader_alive(self, rank: int) -> bool:
        """Whether receiver ``rank`` still holds its reader (:meth:`SegmentReader.hold`)."""
        assert self._fd is not None
        return _rank_lock(self._fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, rank) != fcntl.F_UNLCK

    def ack(self, rank: int) -> Ack:
        """Receiver ``rank``'s control entry (untrusted: the caller checks it)."""
        assert self._mm is not None and 0 <= rank < MAX_RECEIVERS
        at = rank * ACK_BYTES
        token = self._words[at]  # first: the commit word
        return Ack(token, self._words[at + 8], self._words[at + 16])

    def close(self, *, unmap: bool = True) -> None:
        """Close the descriptor (no worker can open it any more) and unmap; idempotent.
        ``unmap=False`` leaves the mapping to the GC, for tensors that live on in it (shared
        weights): unmapping under them would crash the process."""
        self._finalizer()  # close the descriptor first: nothing new can attach
        self._fd = None
        self._buf = None
        self._words.release()
        if self._mm is not None and not unmap:
            self._mm = None  # torch.frombuffer's tensors hold the mmap object until they die
        if self._mm is not None:
            try:
                self._mm.close()  # with the descriptor closed too, this releases the lock
            except BufferError:  # a view escaped; the GC unmaps it with the last view
                pass
            self._mm = None


def _open_segment(name: str, fd_number: int) -> tuple[int, os.stat_result]:
    """Open the trainer's memfd through ``/proc/<pid>/fd/<fd>`` and check, on the descriptor
    opened, everything that makes mapping it safe (docs/ipc.md). ``O_NOFOLLOW`` cannot apply
    to that magic link, hence the link and stat checks; ``O_NONBLOCK``: a FIFO cannot block."""
    pid = segment_pid(name)
    fd_number = check_segment_fd(fd_number)
    path = _PROC_FD.format(pid=pid, fd=fd_number)
    want = _LINK.format(name=name)
    where = f"segment {name!r} (fd {fd_number} of {trainer_of(name)})"
    # Never open a file of the trainer's choosing; checked again on the descriptor itself
    # (the trainer may have replaced the descriptor meanwhile).
    try:
        link = os.readlink(path)
        st = os.stat(path)  # follows the magic link: the file itself
    except FileNotFoundError:
        if not os.path.isdir(f"/proc/{pid}"):
            raise TransferError(
                f"{where}: no process {pid} is visible from this worker: the trainer process "
                f"that owned it ({trainer_of(name)}) has exited, or it runs in another PID "
                "namespace or on another host (the ipc engine needs the trainer and its "
                "workers in one PID namespace on one host)"
            ) from None
        raise PayloadError(
            f"segment_fd: {where}: the trainer holds no descriptor {fd_number}: no "
            "shared-memory segment there (it was closed, or the announcement is stale or forged)"
        ) from None
    except OSError as e:
        raise PayloadError(
            f"segment: cannot open {where} at {path}: {e} (the worker needs the trainer's uid, "
            "and a trainer that is not marked undumpable)"
        ) from e
    if link != want:
        raise PayloadError(
            f"segment: {path} links to {link!r}, not to the announced memfd {want!r}: "
            "not this segment (a stale or forged announcement)"
        )
    _check_stat(st, where)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise PayloadError(f"segment: cannot open {where} at {path}: {e}") from e
    try:
        here = os.fstat(fd)
        _check_stat(here, where)
        if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            raise PayloadError(f"segment: {where} was replaced while it was opened")
        link = os.readlink(f"/proc/self/fd/{fd}")
        if link != want:
            raise PayloadError(
                f"segment: {where} opened as {link!r}, not as the announced memfd {want!r}"
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise PayloadError(f"segment: {where} takes no seals ({e}): not a memfd") from e
        if seals & SEALS != SEALS:
            raise PayloadError(
                f"segment: {where} has seals {seals:#x}; a segment must carry "
                f"F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL ({SEALS:#x}), or another process "
                "could shrink it under this worker's mapping"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, here


def _check_stat(st: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise PayloadError(f"segment: {where} is not a regular shared-memory file")
    if st.st_uid != os.geteuid():
        raise PayloadError(
            f"segment: {where} belongs to uid {st.st_uid}, not to this worker's uid {os.geteuid()}"
        )
    if st.st_size <= 0:
        raise PayloadError(f"segment: {where} is empty")


@functools.cache
def _c_function(name: str) -> Any:
    """The C library's function ``name`` (ctypes drops the GIL per call), or ``None``."""
    try:
        import ctypes

        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _memcpy() -> Callable[[int, int, int], object] | None:
    """The C library's ``memcpy``, typed, or ``None``: 5-8% faster a round than
    ``Tensor.copy_`` (docs/benchmarks.md, "ipc"), and it too runs without the GIL."""
    import ctypes

    fn = _c_function("memcpy")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_void_p
    return fn  # type: ignore[no-any-return]


def _copy_out(buf: torch.Tensor, reads: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Each ``(offset, out)``: ``out.numel()`` bytes at ``offset`` of ``buf`` (checked by
    :meth:`SegmentReader.read_many`)."""
    memcpy = _memcpy()
    if memcpy is None:
        for offset, out in reads:
            out.copy_(buf[offset : offset + out.numel()])
        return
    base = buf.data_ptr()
    for offset, out in reads:
        if n := out.numel():  # an empty tensor may have no address at all
            memcpy(out.data_ptr(), base + offset, n)


def _split_bytes(
    reads: Sequence[tuple[int, torch.Tensor]], parts: int
) -> list[list[tuple[int, torch.Tensor]]]:
    """``reads`` cut into at most ``parts`` lists of about equal bytes, in order; a read that
    straddles a cut is cut in two."""
    if parts <= 1:
        return [list(reads)]
    total = sum(out.numel() for _, out in reads)
    if total == 0:
        return [list(reads)]
    share = -(-total // parts)
    out_parts: list[list[tuple[int, torch.Tensor]]] = [[]]
    room = share
    for offset, out in reads:
        start, n = 0, out.numel()
        while n - start > room and len(out_parts) < parts:
            if room:
                out_parts[-1].append((offset + start, out[start : start + room]))
                start += room
            out_parts.append([])
            room = share
        if n > start:
            out_parts[-1].append((offset + start, out[start:]))
            room -= n - start
    return out_parts


class SegmentReader:
    """A worker's map of one trainer segment, kept across rounds (writable: for its acks).

    One lock covers every use of the mapping and :meth:`close`: an init may close the reader
    while an abandoned round's thread still reads, and reading unmapped memory would crash
    the process; under the lock that reader gets a ``TransferError`` instead.
    """

    def __init__(self, name: str, fd: int) -> None:
        import torch

        self.name = check_segment_name(name)
        self.fd_number = check_segment_fd(fd)
        own, st = _open_segment(name, fd)
        try:
            self.size = st.st_size
            if self.size < CONTROL_BYTES + HEADER_BYTES:
                raise PayloadError(
                    f"segment: {name!r} has {self.size} bytes, less than a control area and "
                    "one slot header"
                )
            if self.size % 8:
                raise PayloadError(f"segment: {name!r} has {self.size} bytes, not whole words")
            self._mm: mmap.mmap | None = mmap.mmap(own, self.size)
        except BaseException:
            os.close(own)
            raise
        _populate(self._mm)
        self._fd: int | None = own
        self._buf: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._words = _Words(self._mm)
        self._lock = threading.RLock()

    def _open_fd(self) -> int:
        if self._fd is None:
            raise TransferError(f"segment {self.name} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def owner_alive(self) -> bool:
        with self._lock:
            return not _unlocked(self._open_fd())

    def check_size(self) -> None:
        """Refuse a segment whose size changed since it was opened: a cheap guard of the
        seals' promise that it cannot."""
        with self._lock:
            now = os.fstat(self._open_fd()).st_size
        if now != self.size:
            raise TransferError(
                f"segment {self.name!r}: {now} bytes while mapped ({self.size} bytes at open) "
                "although it is sealed; refusing to read it"
            )

    def hold(self, rank: int) -> None:
        """Lock byte ``rank`` while this reader is open: the trainer's sign that receiver
        ``rank`` lives, while it waits for acknowledgements the receiver may send after its
        call returned (:meth:`StagingSegment.reader_alive`)."""
        with self._lock:
            _rank_lock(self._open_fd(), fcntl.F_OFD_SETLK, fcntl.F_RDLCK, rank)

    def ack(self, rank: int, token: int, consumed: int, world_size: int) -> None:
        assert 0 <= rank < MAX_RECEIVERS
        with self._lock:
            self._open_fd()
            at = rank * ACK_BYTES
            self._words[at + 16] = world_size
            self._words[at + 8] = consumed
            self._words[at] = token  # last: the entry's commit word

    def header(self, data_offset: int) -> SlotHeader:
        """The slot's header, commit word first (see :meth:`StagingSegment.publish`)."""
        with self._lock:
            self._open_fd()
            assert self._mm is not None
            at = data_offset - HEADER_BYTES
            seq = self._words[at + _SEQ_AT]
            return SlotHeader(bytes(self._mm[at : at + 8]), seq, self._words[at + _LENGTH_AT])

    def view(self, offset: int, length: int) -> torch.Tensor:
        """For tests: unlike :meth:`read_into`, not protected from :meth:`close`."""
        if self._buf is None:
            raise TransferError(f"segment {self.name} is closed")
        return self._buf[offset : offset + length]

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        self.read_many([(offset, out)])

    def read_many(self, reads: Sequence[tuple[int, torch.Tensor]], *, threads: int = 1) -> None:
        """:meth:`read_into` for each ``(offset, out)``, split over ``threads`` threads.

        The helpers are waited for without a timeout on purpose: each copies a bounded range
        of this process's memory, and the lock must be held (no unmap) while one still reads.
        """
        import torch

        for offset, out in reads:
            want = out.numel()
            if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
                raise PayloadError(
                    f"read_many: expected a contiguous uint8 CPU tensor, got {out.dtype} on "
                    f"{out.device}{'' if out.is_contiguous() else ', not contiguous'}"
                )
            if offset < 0 or offset + want > self.size:
                raise PayloadError(
                    f"segment {self.name!r}: {want} bytes at {offset} end past its "
                    f"{self.size} bytes"
                )
        parts = _split_bytes(reads, threads)
        with self._lock:
            self._open_fd()
            buf = self._buf
            assert buf is not None
            helpers = [BackgroundCall(_copy_out, buf, part, name="ipc-copy") for part in parts[1:]]
            try:
                _copy_out(buf, parts[0])
            finally:
                for h in helpers:
                    h.wait(None)
            for h in helpers:
                if h.error is not None:
                    raise h.error

    def close_if_orphaned(self) -> bool:
        """Unmap if the owner is gone, so the kernel can free it; whether it was closed."""
        with self._lock:
            if self._fd is None or self.owner_alive():
                return False
            self.close()
            return True

    def close(self) -> None:
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
