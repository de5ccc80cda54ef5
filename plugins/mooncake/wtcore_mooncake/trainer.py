"""The trainer half of ``mooncake``: staging buffers registered once, read by the workers.

Pull (the four calls cannot carry the workers' memory back): each update names a slot, or with
source reads each tensor's region of the trainer's own memory, registered for that bucket only
(a source may hand out fresh tensors every round). A failed round closes the transfer engine,
which ends every read still under way. See docs/mooncake.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore.errors import TransferError
from wtcore_kit.bucketed import BucketedTrainerEngine, BucketUpdateInfo
from wtcore_mooncake import te
from wtcore_mooncake.wire import MAX_REGIONS, MooncakeTrainerInitInfo

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.meta import ParamMeta
    from wtcore.sharded.plan import PlannedRound
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats
    from wtcore_kit.sharded.schedule import Op
    from wtcore_mooncake.lending import Lender

__all__ = ["MooncakeTrainerEngine"]


class MooncakeTrainerEngine(BucketedTrainerEngine):
    """Announces registered staging at init and each bucket's slot (or regions) in its update."""

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
        for t in slots:
            if t.data_ptr() in self._registered:
                self._registered.remove(t.data_ptr())
                self._engine.unregister_memory(t.data_ptr())

    def release_staging(self) -> None:
        if self._engine is not None:  # a failed round or shutdown: its loans wait for the next
            self._lender().round_failed()
        if self._slots:
            self.release_staging_of(self._slots)
        self._announced = -1
        super().release_staging()

    def round_failed(self) -> None:
        """Free the staging once this process's transfer engine is closed (ending any read of
        the failed round); the next handshake announces a fresh engine."""
        slots = self._slots  # freed only once the engine that may read them is gone
        super().round_failed()
        if self._engine is not None:
            self._engine, self.endpoint = None, ""
            te.close(self.mc_info.address, self.mc_info.protocol)
        del slots

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
        """The kit's slots; grown past what the workers were told, announced again (in
        ``_prepare``: between rounds)."""
        announced = self._announced  # growing releases the old slots, which forgets it
        slots = super().staging(capacity)
        if announced not in (-1, self._capacity):
            self.handshake()
        return slots

    def send_bucket(self, bucket: Bucket, filled: Any, slot: int) -> dict[str, Any]:
        wire = BucketUpdateInfo.wire(bucket.metas)
        if isinstance(filled, list):  # the tensors' own regions (see fill)
            return {**wire, "regions": filled, "nbytes": bucket.nbytes}
        return {**wire, "slot": slot, "nbytes": filled.numel()}

    # ------------------------------------------------------------------ source reads
    def fill(
        self,
        source: WeightSource,
        metas: list[ParamMeta],
        buckets: list[Bucket],
        slots: list[torch.Tensor],
        stats: TransferStats,
    ) -> Iterator[tuple[Bucket, Any]]:
        """Each bucket as its tensors' lent regions, or packed into its slot where it cannot
        be read where it lies."""
        if not self.mc_info.source_reads:
            yield from super().fill(source, metas, buckets, slots, stats)
            return
        from wtcore.buckets import pack_bucket
        from wtcore.source import iter_checked

        lender = self._lender()
        it = iter_checked(source, metas)
        for i, bucket in enumerate(buckets):
            lender.give_back(keep=1)  # the bucket before last was read (see the kit's fill)
            with stats.phase("materialize"):
                tensors = [next(it)[1] for _ in bucket.metas]
            if i == len(buckets) - 1:
                for _ in it:  # iter_checked refuses a source longer than its metadata
                    pass
            regions = lender.lend(tensors) if len(tensors) <= MAX_REGIONS else None
            if regions is not None:
                yield bucket, regions
                continue
            with stats.phase("pack"):
                filled = pack_bucket(bucket, tensors, slots[bucket.index % len(slots)])
            del tensors
            yield bucket, filled
        for _ in it:
            pass

    def _lender(self) -> Lender:
        return te.lender(self.mc_info.address, self.mc_info.protocol)

    def end_round(self, stats: TransferStats) -> None:
        self._lender().round_ended()  # every call returned
        super().end_round(stats)

    # ------------------------------------------------------------------ sharded rounds
    executes_plans: ClassVar[bool] = True

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Pack this rank's buckets into its slots, step by step; rank 0 tells the receivers
        where (:mod:`wtcore_mooncake.pairs`)."""
        from wtcore.sharded.round import gather, together
        from wtcore_kit.bucketed import SETTLE_GRACE_S
        from wtcore_kit.concurrency import BackgroundCall
        from wtcore_kit.sharded.pairs import pack_pair
        from wtcore_kit.sharded.schedule import pair_cuts, schedule_pairs

        info, rank = self.mc_info, self.init_info.rank
        cuts = pair_cuts(planned, info.packed_buffer_size_bytes)
        counts = [(s, d, len(cuts[(s, d)])) for s, d in planned.plan.pairs()]
        # Two halves of the slots, when there are two: one packed while the other is read.
        half = max(1, info.packed_num_buffers // 2)
        overlap = info.packed_num_buffers >= 2
        steps = schedule_pairs(counts, half)
        receivers = planned.receivers[0].world_size if planned.receivers else 0
        largest = max((b.nbytes for bs in cuts.values() for b, _ in bs), default=0)

        def prepare() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
            self._transfer_engine()
            grown = bool(self._slots) and self._capacity < largest
            slots = BucketedTrainerEngine.staging(self, max(largest, 1))  # registered, unannounced
            self.needs_handshake = self.needs_handshake or grown  # rank 0's workers: new slots
            return slots, dict(source)

        got = together("reading its parts and registering its slots", prepare)
        assert got is not None
        slots, local = got
        every = gather(
            {"endpoint": self.endpoint, "slots": [[t.data_ptr(), t.numel()] for t in slots]}
        )
        client = self.client

        def announce() -> None:
            assert client is not None
            with stats.phase("wire"):
                client.update_weights({"senders": every})

        together("announcing the slots", announce if rank == 0 else None)
        stats.bytes_sent = 0
        pending: list[BackgroundCall[Any]] = []  # rank 0: the last step's update, in flight

        def settle(t: int) -> None:
            calls = pending[:]
            pending.clear()

            def wait() -> None:
                with stats.phase("wire"):
                    for call in calls:
                        call.result(info.timeout_s + SETTLE_GRACE_S)

            together(f"the receivers reading step {t}", wait)

        for t, step in enumerate(steps):
            if t and not overlap:
                settle(t - 1)
            base = (t % 2) * half if overlap else 0

            def pack(step: list[Op] = step, base: int = base) -> dict[int, list[dict[str, int]]]:
                reads: dict[int, list[dict[str, int]]] = {}
                with stats.phase("pack"):
                    for i, op in enumerate(o for o in step if o.src == rank):
                        bucket, chunks = cuts[(op.src, op.dst)][op.bucket]
                        pack_pair(bucket, chunks, local, slots[base + i])
                        reads.setdefault(op.dst, []).append(
                            {"src": rank, "bucket": op.bucket, "slot": base + i}
                        )
                        stats.num_buckets += 1
                        stats.bytes_sent = (stats.bytes_sent or 0) + bucket.payload_nbytes
                return reads

            entries: list[dict[str, Any]] = [{"reads": []} for _ in range(receivers)]
            for part in gather(together(f"packing step {t}", pack)):  # [] but on rank 0
                for d, items in part.items():
                    entries[d]["reads"].extend(items)
            if t and overlap:
                settle(t - 1)  # before its update goes, and before its half is packed again
            if rank == 0:
                assert client is not None
                pending.append(
                    BackgroundCall(client.update_weights, entries, name="update_weights")
                )
        if steps:
            settle(len(steps) - 1)

    def shutdown(self) -> None:
        super().shutdown()  # releases (unregisters) the staging; the transfer engine stays
        self._engine = None  # the process's, but no longer held here (see round_failed)
