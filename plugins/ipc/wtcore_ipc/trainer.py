"""The trainer half of ``ipc``: pack buckets into reused staging buffers, announce them as JSON.

Built on :class:`wtcore.kit.BucketedTrainerEngine`, which plans, packs, pipelines (the
``update_weights`` call for bucket ``k`` runs while bucket ``k+1`` is packed into the other
staging buffer) and recovers; this module only puts the staging buffers in shared memory (CPU)
or exported GPU memory (CUDA) and says where each bucket lies.

Multi-rank trainers: only the sender (rank 0) stages. Every rank materializes the full tensors
in lockstep anyway (that is what gathers FSDP shards), so a second gather would add nothing;
the sender sends ONE payload that every colocated worker reads (they all map the sender's
segment, or import the sender's CUDA buffer and copy it to their own GPU). See docs/ipc.md.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from wtcore.kit import BucketedTrainerEngine, BucketUpdateInfo
from wtcore_ipc.shm import StagingSegment, host_status
from wtcore_ipc.wire import IPCInitInfo, IPCTrainerInitInfo

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore_ipc.cuda import CudaStaging

__all__ = ["IPCTrainerEngine"]


class IPCTrainerEngine(BucketedTrainerEngine):
    """Stages buckets in shared memory (CPU) or exported GPU buffers (CUDA)."""

    init_info_cls = IPCTrainerInitInfo
    _memory: StagingSegment | CudaStaging | None = None
    _seq = 0

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    @property
    def segment_name(self) -> str | None:
        """The current shared-memory segment (CPU), for diagnostics and tests."""
        return self._memory.name if isinstance(self._memory, StagingSegment) else None

    def worker_init_info(self) -> dict[str, Any]:
        info = self.info
        assert isinstance(info, IPCTrainerInitInfo)
        return asdict(
            IPCInitInfo(
                transport=info.transport,
                packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes,
                packed_num_buffers=info.packed_num_buffers,
            )
        )

    def allocate_staging(self, capacity: int, count: int) -> list[torch.Tensor]:
        info = self.info
        assert isinstance(info, IPCTrainerInitInfo)
        if info.transport == "shm":
            self._memory = StagingSegment(capacity, count)
        else:
            from wtcore_ipc.cuda import CudaStaging

            self._memory = CudaStaging(capacity, count, info.device)
        return [self._memory.slot(i) for i in range(count)]

    def release_staging(self) -> None:
        """Unlink the segment (or free the exported buffers): errors never leak segments."""
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        super().release_staging()

    def send_bucket(self, bucket: Bucket, filled: torch.Tensor, slot: int) -> dict[str, Any]:
        memory = self._memory
        assert memory is not None, "the kit allocates staging before packing"
        self._seq += 1
        payload: dict[str, Any] = {
            **BucketUpdateInfo.wire(bucket.metas),
            "sizes": [m.nbytes for m in bucket.metas],
            "length": bucket.nbytes,
            "seq": self._seq,
        }
        if isinstance(memory, StagingSegment):
            memory.publish(slot, self._seq, bucket.nbytes)
            payload["offset"] = memory.data_offset(slot)
            payload["segment"] = memory.name
        else:
            memory.publish(slot)
            payload["offset"] = 0
            payload["cuda"] = dict(memory.handles[slot])
        return payload

    from wtcore_ipc.bench import BENCH as bench  # wtcore bench: see wtcore_ipc/bench.py
