"""What travels on the control plane: plain JSON dataclasses, never pickle.

* :class:`IPCTrainerInitInfo`: the trainer's settings (the only place they live).
* :class:`IPCInitInfo`: what the trainer ships to every worker at init.
* :class:`IPCUpdateInfo`: the kit's bucket metadata plus where the bytes are: on CPU the whole
  round's ring of shared-memory slots (one call per round) in a sealed memfd of the trainer,
  on GPU one bucket in an encoded CUDA IPC buffer; validated on arrival.
"""

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

#: Default bucket (= slot) size. With one control call per round a bucket costs no round trip,
#: so small slots let packing (trainer) and copying out (worker) overlap from the first bucket
#: and keep the ring small; measured in docs/benchmarks.md ("ipc"). A tensor larger than a
#: slot is streamed through the ring in slot-sized chunks.
DEFAULT_BUFFER_SIZE = 16 << 20
#: Default slot count: enough that a worker waking up late finds the next slots filled.
DEFAULT_NUM_BUFFERS = 4
#: ``shm``: POSIX shared memory (CPU). ``cuda``: CUDA IPC handles (GPU, untested here).
TRANSPORTS = ("shm", "cuda")


@dataclass
class IPCTrainerInitInfo(BucketedTrainerInitInfo):
    """Trainer settings of the ``ipc`` engine (see
    :class:`~wtcore_kit.bucketed.BucketedTrainerInitInfo`).

    ``packed_num_buffers`` slots of ``packed_buffer_size_bytes`` form the ring (CPU): the
    trainer packs the next chunks while workers copy out the previous ones.
    ``device`` picks the transport: ``"cpu"`` stages in POSIX shared memory, ``"cuda[:N]"`` in
    GPU memory shared by CUDA IPC.
    ``share_weights`` (CPU): at its first round the sender moves the model of a
    :class:`~wtcore.source.ModuleSource` into shared memory (:func:`wtcore_ipc.share_weights`)
    where that is safe (:func:`wtcore_ipc.shared.why_not_movable`), so rounds copy each byte
    once instead of twice through the ring; ``False`` leaves the model's memory alone.
    """

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
    """Shipped to every worker at init: how buckets are planned, where bytes come from, and
    how long a worker waits for the trainer's next slot (``timeout_s``)."""

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
    """One ``update_weights`` call. Three shapes:

    * ``shm`` (CPU): the whole round in ONE call. The metadata lists every tensor of the round;
      ``segment`` names the trainer's ring of ``num_slots`` slots of ``slot_bytes`` each (the
      bucket size, aligned). The buckets of the shared plan travel as chunks: a bucket that
      fits a slot is one chunk, a bigger one (a single large tensor) is cut into slot-sized
      chunks; chunk ``f`` of the round arrives in slot ``f % num_slots`` with sequence number
      ``seq + f`` in its header. The worker consumes slot after slot as the trainer fills them.
    * ``shm`` with shared weights (:func:`wtcore_ipc.share_weights`): the whole round in ONE
      call, no ring: ``segment`` holds the trainer's tensors themselves, the i-th listed tensor
      at byte ``offsets[i]`` of its data area, and its header carries ``seq``.
    * Both ``shm`` shapes: ``segment`` is the name of the trainer's memfd
      (``wtcore_ipc_<pid>_<token>``, the trainer's pid and a random token) and ``segment_fd``
      its descriptor number in the trainer: the worker opens ``/proc/<pid>/fd/<segment_fd>``
      and checks that it is that memfd, sealed (:mod:`wtcore_ipc.shm`).
    * ``cuda`` (GPU): one bucket per call, at ``offset``/``length`` of the exported buffer
      ``cuda``; ``sizes`` are the tensors' byte sizes, checked against the metadata.
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
        """Offsets into shared weights: one per tensor, in range, aligned for its dtype (the
        bounds against the segment's size are the worker's, once it has the segment)."""
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
        """The round's buckets, re-planned with the shared rule (``shm``), once the ring's shape
        is checked against what the trainer advertised at init."""
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
        """Re-plan with the shared rule (``cuda``): exactly one bucket of ``length``."""
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
