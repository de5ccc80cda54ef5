"""The trainer half of ``mooncake``: staging buffers registered once, read by the workers.

Pull, because it fits the protocol's direction: the trainer's transfer engine registers its
``packed_num_buffers`` staging buffers when it announces them (each handshake), and every
``update_weights`` names the slot a packed bucket lies in; each worker reads the bucket with
one ``transfer_sync_read`` and returns from ``update_weights`` once it has it. The kit
(:class:`~wtcore_kit.bucketed.BucketedTrainerEngine`) packs the next bucket into the other slot
meanwhile, and writes a slot again only after the call that announced it returned from every
worker, so no worker ever reads a slot being rewritten. Push would need each worker's
registered memory announced back to the trainer, which the four calls have no way to carry.

A round whose largest bucket (a tensor larger than ``packed_buffer_size_bytes``) does not fit
the announced slots grows them and announces them again (a fresh handshake) before it starts.
A failed round unregisters and frees the staging; the next handshake registers it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from wtcore.errors import TransferError
from wtcore_kit.bucketed import BucketedTrainerEngine, BucketUpdateInfo
from wtcore_mooncake import te
from wtcore_mooncake.wire import MooncakeTrainerInitInfo

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.plan import PlannedRound
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = ["MooncakeTrainerEngine"]


class MooncakeTrainerEngine(BucketedTrainerEngine):
    """Announces registered staging at init and each bucket's slot in its update."""

    init_info_cls = MooncakeTrainerInitInfo

    def __init__(self, init_info: Any, **kwargs: Any) -> None:
        super().__init__(init_info, **kwargs)
        assert isinstance(init_info, MooncakeTrainerInitInfo)
        self.mc_info = init_info
        self._engine: Any = None
        self.endpoint = ""
        self._registered: list[int] = []
        self._announced = -1  # the slot size the workers were last told (-1: none yet)

    @classmethod
    def host_status(cls) -> str:
        return te.host_status()

    def _transfer_engine(self) -> Any:
        if self._engine is None:
            self._engine, self.endpoint = te.start(self.mc_info.address, self.mc_info.protocol)
        return self._engine

    # ------------------------------------------------------------------ staging
    def allocate_staging(self, capacity: int, count: int) -> list[torch.Tensor]:
        engine = self._transfer_engine()
        slots = super().allocate_staging(capacity, count)
        for t in slots:
            rc = engine.register_memory(t.data_ptr(), capacity)
            if rc != 0:
                self.release_staging_of(slots)
                raise TransferError(
                    f"Mooncake could not register {capacity} bytes of staging (status {rc})"
                )
            self._registered.append(t.data_ptr())
        return slots

    def release_staging_of(self, slots: list[torch.Tensor]) -> None:
        """Unregister whatever of ``slots`` was registered (the tensors are then freed)."""
        for t in slots:
            if t.data_ptr() in self._registered:
                self._registered.remove(t.data_ptr())
                self._engine.unregister_memory(t.data_ptr())

    def release_staging(self) -> None:
        if self._slots:
            self.release_staging_of(self._slots)
        self._announced = -1
        super().release_staging()

    # ------------------------------------------------------------------ the protocol
    def worker_init_info(self) -> dict[str, Any]:
        info = self.mc_info
        slots = self.staging(max(self._capacity, info.packed_buffer_size_bytes))
        self._announced = self._capacity
        return {
            "endpoint": self.endpoint,
            "slots": [[t.data_ptr(), t.numel()] for t in slots],
            "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
            "packed": info.packed,
            "protocol": info.protocol,
            "timeout_s": info.timeout_s,
            "direct_min_bytes": info.direct_min_bytes,
        }

    def staging(self, capacity: int) -> list[torch.Tensor]:
        """The kit's slots; grown past what the workers were told, they are announced again.

        The kit sizes the slots for a round before its ``start_weight_update``, so the fresh
        handshake lands between rounds.
        """
        announced = self._announced  # growing releases the old slots, which forgets it
        slots = super().staging(capacity)
        if announced not in (-1, self._capacity):
            self.handshake()
        return slots

    def send_bucket(self, bucket: Bucket, filled: torch.Tensor, slot: int) -> dict[str, Any]:
        return {**BucketUpdateInfo.wire(bucket.metas), "slot": slot, "nbytes": filled.numel()}

    # ------------------------------------------------------------------ sharded rounds
    executes_plans: ClassVar[bool] = True

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Register this rank's parts of ``planned`` for the receivers to read; rank 0 tells
        them where every rank's parts lie (see :mod:`wtcore_mooncake.pairs`)."""
        from wtcore.sharded_round import agree, gather
        from wtcore_mooncake.pairs import parts_of, register_parts

        rank = self.init_info.rank
        sizes = parts_of(planned, rank)
        parts: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            engine = self._transfer_engine()
            parts = register_parts(engine, dict(source), sizes)
        except BaseException as e:
            error = e
        try:
            agree(error, "registering its parts for the receivers")
            entry = {
                "endpoint": self.endpoint,
                "tensors": {n: [t.data_ptr(), sizes[n]] for n, t in parts.items()},
            }
            every = gather(entry)
            error = None
            if rank == 0:
                assert self.client is not None
                try:
                    with stats.phase("wire"):
                        self.client.update_weights({"senders": every})
                except BaseException as e:
                    error = e
            agree(error, "the receivers reading every rank's parts")
            stats.bytes_sent = planned.plan.nbytes(src=rank)
        finally:
            for t in parts.values():
                self._engine.unregister_memory(t.data_ptr())

    def shutdown(self) -> None:
        super().shutdown()  # releases (unregisters) the staging; the transfer engine stays
