"""What travels on the control plane: plain JSON dataclasses, never pickle.

* :class:`IPCTrainerInitInfo`: the trainer's settings (the only place they live).
* :class:`IPCInitInfo`: what the trainer ships to every worker at init.
* :class:`IPCUpdateInfo`: one bucket: the kit's bucket metadata plus where its bytes are (a shared
  memory segment on CPU, an encoded CUDA IPC handle on GPU), validated on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from wtcore.buckets import ALIGNMENT, Bucket, plan_round
from wtcore.errors import PayloadError
from wtcore.kit import BucketedTrainerInitInfo, BucketUpdateInfo, check_bucket_options
from wtcore_ipc.shm import HEADER_BYTES, check_segment_name

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "TRANSPORTS",
    "IPCInitInfo",
    "IPCTrainerInitInfo",
    "IPCUpdateInfo",
]

#: Default bucket size: small enough that packing one bucket overlaps the worker's copy of
#: the previous one, large enough that per-call overhead is noise; the fastest setting measured
#: (docs/benchmarks.md, "ipc"). The segment is sized to the largest bucket, so small models
#: never pay for it.
DEFAULT_BUFFER_SIZE = 256 << 20
#: ``shm``: POSIX shared memory (CPU). ``cuda``: CUDA IPC handles (GPU, untested here).
TRANSPORTS = ("shm", "cuda")


@dataclass
class IPCTrainerInitInfo(BucketedTrainerInitInfo):
    """Trainer settings of the ``ipc`` engine (see :class:`~wtcore.kit.BucketedTrainerInitInfo`).

    ``packed_num_buffers`` staging buffers let the trainer pack the next bucket while the
    worker copies the previous one; the worker serializes calls, so more than two add nothing.
    ``device`` picks the transport: ``"cpu"`` stages in POSIX shared memory, ``"cuda[:N]"`` in
    GPU memory shared by CUDA IPC.
    """

    backend: ClassVar[str] = "ipc"
    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)
    device: str = field(default="cpu", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise PayloadError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @property
    def transport(self) -> str:
        return "shm" if self.device == "cpu" else "cuda"


@dataclass
class IPCInitInfo:
    """Shipped to every worker at init: how buckets are planned and where bytes come from."""

    transport: str
    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise PayloadError(
                f"transport: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        check_bucket_options(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
        )


@dataclass
class IPCUpdateInfo(BucketUpdateInfo):
    """One bucket. ``offset``/``length`` locate its bytes in the segment (CPU) or in the
    exported CUDA buffer; ``sizes`` are the tensors' byte sizes, checked against the metadata;
    ``seq`` must match the slot header the trainer stamped (CPU)."""

    sizes: list[int]
    offset: int
    length: int
    seq: int
    segment: str | None = None
    cuda: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.sizes) != len(self.metas):
            raise PayloadError(
                f"sizes: expected {len(self.metas)} entries (one per name), got {len(self.sizes)}"
            )
        for i, (m, s) in enumerate(zip(self.metas, self.sizes, strict=True)):
            if s != m.nbytes:
                raise PayloadError(
                    f"sizes[{i}]: {m.name!r} is {m.dtype} {list(m.shape)} = {m.nbytes} bytes, "
                    f"got {s}"
                )
        for name in ("offset", "length", "seq"):
            if getattr(self, name) < 0:
                raise PayloadError(
                    f"{name}: expected a non-negative integer, got {getattr(self, name)}"
                )
        if self.offset % ALIGNMENT:
            raise PayloadError(f"offset: expected a multiple of {ALIGNMENT}, got {self.offset}")
        if (self.segment is None) == (self.cuda is None):
            raise PayloadError(
                "update_info: exactly one of 'segment' (CPU) or 'cuda' (GPU) is needed"
            )
        if self.segment is not None:
            check_segment_name(self.segment)
            if self.offset < HEADER_BYTES:
                raise PayloadError(
                    f"offset: a slot's data starts at or after byte {HEADER_BYTES}, "
                    f"got {self.offset}"
                )

    def bucket(self, init: IPCInitInfo) -> Bucket:
        """Re-plan with the shared rule; the update must be exactly one bucket of ``length``."""
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
