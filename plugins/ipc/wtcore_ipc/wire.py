"""What travels on the control plane: plain JSON dataclasses, never pickle, checked on arrival."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from wtcore.buckets import ALIGNMENT, Bucket, align, plan_round
from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import PayloadError
from wtcore_ipc.shm import check_segment_fd, check_segment_name
from wtcore_kit.bucketed import BucketedTrainerInitInfo, BucketUpdateInfo, check_bucket_options

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_NUM_BUFFERS",
    "TRANSPORTS",
    "IPCInitInfo",
    "IPCTrainerInitInfo",
    "IPCUpdateInfo",
]

#: Small slots: with no call per bucket, packing and copying out overlap from the first one.
DEFAULT_BUFFER_SIZE = 16 << 20
DEFAULT_NUM_BUFFERS = 4  # a worker waking up late finds the next slots filled
#: ``shm``: POSIX shared memory (CPU). ``cuda``: CUDA IPC handles (GPU, untested here).
TRANSPORTS = ("shm", "cuda")


@dataclass
class IPCTrainerInitInfo(BucketedTrainerInitInfo):
    """Trainer settings of the ``ipc`` engine (the table in docs/ipc.md)."""

    backend: ClassVar[str] = "ipc"
    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)
    packed_num_buffers: int = field(default=DEFAULT_NUM_BUFFERS, kw_only=True)
    device: str = field(default="cpu", kw_only=True)
    share_weights: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.share_weights, bool):
            raise PayloadError(f"share_weights: expected a bool, got {self.share_weights!r}")
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise PayloadError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @property
    def transport(self) -> str:
        return "shm" if self.device == "cpu" else "cuda"


@dataclass
class IPCInitInfo:
    """Shipped to every worker at init, so both ends plan the same buckets and wait as long."""

    transport: str
    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise PayloadError(
                f"transport: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        check_bucket_options(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            timeout_s=self.timeout_s,
        )


def _non_negative(info: object, *names: str) -> None:
    for name in names:
        value = getattr(info, name)
        if value is not None and value < 0:
            raise PayloadError(f"{name}: expected a non-negative integer, got {value}")


def _require(info: object, kind: str, *names: str) -> None:
    missing = [n for n in names if getattr(info, n) is None]
    if missing:
        raise PayloadError(f"update_info: {kind} needs {', '.join(repr(n) for n in missing)}")


@dataclass
class IPCUpdateInfo(BucketUpdateInfo):
    """One ``update_weights`` call, in one of three shapes:

    * ``shm`` ring: the whole round; chunk ``f`` arrives in slot ``f % num_slots`` of the
      trainer's memfd ``segment`` (descriptor ``segment_fd`` in the trainer), stamped ``seq + f``.
    * ``shm`` shared weights: the whole round; tensor ``i`` at byte ``offsets[i]`` of the
      segment's one slot, whose header carries ``seq``.
    * ``cuda``: one bucket at ``offset``/``length`` of the exported buffer ``cuda``; ``sizes``
      are the tensors' byte sizes.
    """

    seq: int
    segment: str | None = None
    segment_fd: int | None = None
    num_slots: int | None = None
    slot_bytes: int | None = None
    cuda: dict[str, Any] | None = None
    sizes: list[int] | None = None
    offset: int | None = None
    length: int | None = None
    offsets: list[int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _non_negative(self, "seq", "num_slots", "slot_bytes", "offset", "length")
        if self.seq >= 1 << 62:
            raise PayloadError(f"seq: expected a number below 2**62, got {self.seq}")
        if (self.segment is None) == (self.cuda is None):
            raise PayloadError(
                "update_info: exactly one of 'segment' (CPU) or 'cuda' (GPU) is needed"
            )
        if self.segment is not None:
            check_segment_name(self.segment)
            _require(self, "a 'segment' update", "segment_fd")
            check_segment_fd(self.segment_fd)
            if self.offsets is not None:
                self._check_offsets(self.offsets)
                return
            _require(self, "a 'segment' (ring) update", "num_slots", "slot_bytes")
            assert self.num_slots is not None and self.slot_bytes is not None
            if self.num_slots < 1:
                raise PayloadError(f"num_slots: expected at least 1, got {self.num_slots}")
            if self.slot_bytes % ALIGNMENT:
                raise PayloadError(
                    f"slot_bytes: expected a multiple of {ALIGNMENT}, got {self.slot_bytes}"
                )
            return
        _require(self, "a 'cuda' update", "sizes", "offset", "length")
        assert self.sizes is not None and self.offset is not None
        if len(self.sizes) != len(self.metas):
            raise PayloadError(
                f"sizes: expected {len(self.metas)} entries (one per name), got {len(self.sizes)}"
            )
        for i, (m, sz) in enumerate(zip(self.metas, self.sizes, strict=True)):
            if sz != m.nbytes:
                raise PayloadError(
                    f"sizes[{i}]: {m.name!r} is {m.dtype} {list(m.shape)} = {m.nbytes} bytes, "
                    f"got {sz}"
                )
        if self.offset % ALIGNMENT:
            raise PayloadError(f"offset: expected a multiple of {ALIGNMENT}, got {self.offset}")

    def _check_offsets(self, offsets: list[int]) -> None:
        """One offset per tensor, aligned for its dtype (the worker checks the segment's end)."""
        if len(offsets) != len(self.metas):
            raise PayloadError(
                f"offsets: expected {len(self.metas)} entries (one per name), got {len(offsets)}"
            )
        for i, (m, off) in enumerate(zip(self.metas, offsets, strict=True)):
            if not 0 <= off < 1 << 62 or off % m.dtype.itemsize:
                raise PayloadError(
                    f"offsets[{i}]: {m.name!r} ({m.dtype}) cannot start at byte {off}: expected "
                    f"a non-negative multiple of {m.dtype.itemsize} below 2**62"
                )

    def plan(self, init: IPCInitInfo) -> list[Bucket]:
        """``shm``: the round's buckets, once the ring's shape matches what init advertised."""
        if self.num_slots != init.packed_num_buffers:
            raise PayloadError(
                f"num_slots: the trainer advertised packed_num_buffers="
                f"{init.packed_num_buffers} at init, got {self.num_slots}"
            )
        if self.slot_bytes != align(init.packed_buffer_size_bytes):
            raise PayloadError(
                f"slot_bytes: the trainer advertised packed_buffer_size_bytes="
                f"{init.packed_buffer_size_bytes} at init (slots of "
                f"{align(init.packed_buffer_size_bytes)} bytes), got {self.slot_bytes}"
            )
        return plan_round(
            self.metas, packed=init.packed, buffer_size_bytes=init.packed_buffer_size_bytes
        )

    def bucket(self, init: IPCInitInfo) -> Bucket:
        """``cuda``: the one bucket of ``length`` these tensors must make."""
        buckets = plan_round(
            self.metas, packed=init.packed, buffer_size_bytes=init.packed_buffer_size_bytes
        )
        if len(buckets) != 1:
            raise PayloadError(
                f"update_info: holds {len(buckets)} buckets' worth of tensors; the bucket size "
                f"advertised at init is {init.packed_buffer_size_bytes} bytes "
                f"(packed={init.packed})"
            )
        if buckets[0].nbytes != self.length:
            raise PayloadError(
                f"length: the listed tensors occupy {buckets[0].nbytes} bytes, got {self.length}"
            )
        return buckets[0]
