"""The trainer half of ``ipc``: pack buckets into reused staging buffers, announce them as JSON.

Buckets come from the shared rule (:func:`wtcore.buckets.plan_buckets`) and are packed by
:func:`wtcore.buckets.pack_source`, which checks the source against its metadata before a
bucket is announced. With two or more staging buffers the ``update_weights`` call for bucket
``k`` runs on a helper thread while bucket ``k+1`` is packed into the other buffer; a buffer is
written again only after the call that announced it has returned (the worker has copied it
out). The worker serializes calls, so at most one is in flight and more than two buffers add
nothing.

Multi-rank trainers: only the sender (rank 0) stages. Every rank materializes the full tensors
in lockstep anyway (that is what gathers FSDP shards), so a second gather would add nothing;
the sender sends ONE payload that every colocated worker reads (they all map the sender's
segment, or import the sender's CUDA buffer and copy it to their own GPU). See docs/ipc.md.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from wtcore.buckets import Bucket, max_bucket_nbytes, pack_source, plan_buckets
from wtcore.concurrency import BackgroundCall
from wtcore.errors import TransferTimeoutError
from wtcore.meta import metas_to_wire
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine
from wtcore_ipc.shm import SHM_DIR, StagingSegment
from wtcore_ipc.wire import IPCInitInfo, IPCTrainerInitInfo, plan_size

if TYPE_CHECKING:
    import torch

    from wtcore.client import WeightSyncClient
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats
    from wtcore_ipc.cuda import CudaStaging

__all__ = ["IPCTrainerEngine"]


class IPCTrainerEngine(TrainerWeightTransferEngine):
    """Stages buckets in shared memory (CPU) or exported GPU buffers (CUDA)."""

    init_info_cls = IPCTrainerInitInfo

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None,
    ) -> None:
        super().__init__(init_info, client=client, source=source)
        self._staging: StagingSegment | CudaStaging | None = None
        self._seq = 0

    @classmethod
    def host_status(cls) -> str:
        import os

        shm = "shm ok" if os.path.isdir(SHM_DIR) else f"shm unavailable (no {SHM_DIR})"
        return f"{shm}; cuda ipc untested"

    def worker_init_info(self) -> dict[str, Any]:
        info = self._info()
        return asdict(
            IPCInitInfo(
                transport=info.transport,
                packed=info.packed,
                buffer_size_bytes=info.packed_buffer_size_bytes,
                num_buffers=info.packed_num_buffers,
            )
        )

    @property
    def segment_name(self) -> str | None:
        """The current shared-memory segment (CPU), for diagnostics and tests."""
        return self._staging.name if isinstance(self._staging, StagingSegment) else None

    def _info(self) -> IPCTrainerInitInfo:
        assert isinstance(self.init_info, IPCTrainerInitInfo)
        return self.init_info

    def _ensure_staging(self, capacity: int) -> StagingSegment | CudaStaging:
        """Reuse the staging buffers; replace them only when a bigger bucket needs room."""
        info = self._info()
        if self._staging is not None and self._staging.capacity >= capacity:
            return self._staging
        self._drop_staging()  # between rounds: every earlier bucket was acknowledged
        if info.transport == "shm":
            self._staging = StagingSegment(capacity, info.packed_num_buffers)
        else:
            from wtcore_ipc.cuda import CudaStaging

            self._staging = CudaStaging(capacity, info.packed_num_buffers, info.device)
        return self._staging

    def _drop_staging(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def _payload(self, staging: StagingSegment | CudaStaging, bucket: Bucket) -> dict[str, Any]:
        slot = bucket.index % self._info().packed_num_buffers
        self._seq += 1
        payload: dict[str, Any] = {
            **metas_to_wire(bucket.metas),
            "sizes": [m.nbytes for m in bucket.metas],
            "length": bucket.nbytes,
            "seq": self._seq,
        }
        if isinstance(staging, StagingSegment):
            staging.publish(slot, self._seq, bucket.nbytes)
            payload["offset"] = staging.data_offset(slot)
            payload["segment"] = staging.name
        else:
            staging.publish(slot)
            payload["offset"] = 0
            payload["cuda"] = dict(staging.handles[slot])
        return payload

    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        info = self._info()
        client = self.client
        assert client is not None
        metas = source.metadata()
        buckets = plan_buckets(metas, plan_size(info.packed, info.packed_buffer_size_bytes))
        stats.num_tensors = len(metas)
        stats.num_bytes = sum(m.nbytes for m in metas)
        staging = self._ensure_staging(max_bucket_nbytes(buckets)) if buckets else None
        nbuf = info.packed_num_buffers
        with stats.phase("control"):
            client.start_weight_update()
        inflight: BackgroundCall[None] | None = None

        def settle() -> None:
            nonlocal inflight
            if inflight is not None:
                call, inflight = inflight, None
                with stats.phase("wire"):
                    call.result(info.timeout_s)

        def buffer_for(b: Bucket) -> torch.Tensor:
            assert staging is not None  # there are buckets, so there is staging
            return staging.slot(b.index % nbuf)

        try:
            for bucket, _filled in pack_source(source, metas, buckets, buffer_for, stats):
                assert staging is not None
                payload = self._payload(staging, bucket)
                settle()  # one call in flight at a time; its buffer is free again after this
                inflight = BackgroundCall(client.update_weights, payload, name="update_weights")
                stats.num_buckets += 1
                if nbuf == 1:
                    settle()  # the next bucket reuses this very buffer
            settle()
        except BaseException as e:
            # Let a call still reading our buffer finish (bounded), so no transfer outlives
            # send_weights; then unlink the staging buffers: errors never leak segments.
            if inflight is not None and not isinstance(e, TransferTimeoutError):
                inflight.wait(info.timeout_s)
            self._drop_staging()
            raise
        with stats.phase("control"):
            client.finish_weight_update(stats.weight_version)

    def shutdown(self) -> None:
        self._drop_staging()
        super().shutdown()
