"""The trainer half of ``ipc``: pack buckets into reused staging buffers, announce them as JSON.

CPU (``shm``): ONE ``update_weights`` per round announces the ring and the plan, and the kit's
loop packs into the next free slot while workers copy the previous ones out; or, when the
source's tensors live in shared weights, the call lists their offsets (no ring, no copy
here). GPU (``cuda``): the kit's pipeline, one call per bucket. See docs/ipc.md.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from wtcore.buckets import pack_source
from wtcore.errors import TransferError
from wtcore.source import ModuleSource, WeightSource, iter_checked
from wtcore_ipc.ring import chunks, wait_until
from wtcore_ipc.shared import SharedWeights, locate, share_weights, why_not_movable
from wtcore_ipc.shm import CANCELLED, GAVE_UP, MAX_RECEIVERS, StagingSegment, host_status
from wtcore_ipc.wire import IPCInitInfo, IPCTrainerInitInfo
from wtcore_kit.bucketed import BucketedTrainerEngine, BucketUpdateInfo
from wtcore_kit.concurrency import BackgroundCall

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.client import WeightSyncClient
    from wtcore.meta import ParamMeta
    from wtcore.stats import TransferStats
    from wtcore.trainer import TrainerInitInfo
    from wtcore_ipc.cuda import CudaStaging


__all__ = ["IPCTrainerEngine"]

log = logging.getLogger(__name__)

#: How long a worker's failing update call gets to bring its error back, after its "gave up".
_GAVE_UP_WAIT_S = 10.0


class _Resumed(WeightSource):
    """``source`` with its first item already taken: one pass over that item, then the rest
    of the pass that produced it (a source's pass may be a collective: it is never rerun)."""

    def __init__(self, source: WeightSource, first: tuple[str, torch.Tensor], rest: Iterator[Any]):
        self.source, self.first, self.rest = source, first, rest

    def metadata(self) -> list[ParamMeta]:
        return self.source.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield self.first
        for meta, t in self.rest:
            yield meta.name, t


class _Ring:
    """One round in the ring: chunk ``f`` goes into slot ``f % num_slots`` once every worker
    has acknowledged chunk ``f - num_slots``. Acknowledgements are hostile input: a bad one is
    an error naming the rank, never a reason to overwrite a slot early."""

    def __init__(
        self, memory: StagingSegment, first: int, total: int, timeout_s: float, stats: TransferStats
    ) -> None:
        self.memory, self.first, self.total = memory, first, total
        self.timeout_s, self.stats = timeout_s, stats
        self.published = 0  # chunks stamped so far
        self.call: BackgroundCall[Any] | None = None  # the round's one update_weights

    def consumed(self, published: int) -> int:
        """Chunks of this round every worker has consumed (0 before all reported)."""
        head = self.memory.ack(0)
        if head.token != self.first:
            return 0
        world = head.world_size
        if world == 0:
            return 0  # rank 0 is writing its first entry of the round
        if world > MAX_RECEIVERS:
            raise TransferError(
                f"ipc ring {self.memory.name}: rank 0 reports world_size={world}, expected "
                f"1..{MAX_RECEIVERS}"
            )
        low = published
        for rank in range(world):
            ack = self.memory.ack(rank)
            if ack.token != self.first:
                return 0
            if ack.consumed == GAVE_UP:
                raise self._gave_up(rank, published)
            if ack.world_size != world or ack.consumed > published:
                raise TransferError(
                    f"ipc ring {self.memory.name}: rank {rank} acknowledged {ack.consumed} of "
                    f"{published} published chunks with world_size={ack.world_size} (rank 0 "
                    f"says {world}): refusing to trust the ring"
                )
            low = min(low, ack.consumed)
        return low

    def _gave_up(self, rank: int, published: int) -> BaseException:
        """Rank ``rank`` acknowledged "gave up": its own error, when its update call brings it
        back (the ring is cancelled first, so the others stop waiting), else one naming it."""
        self.cancel()
        call = self.call
        if call is not None and call.wait(_GAVE_UP_WAIT_S) and call.error is not None:
            return call.error
        return TransferError(
            f"ipc ring {self.memory.name}: receiver rank {rank} gave up the round after "
            f"{published} published chunks (its error is in its update's receive)"
        )

    def free_slot(self) -> torch.Tensor:
        """The next chunk's slot, once every worker consumed its last tenant."""
        index, nslots = self.published, self.memory.num_slots
        need = index - nslots + 1  # chunks consumed by then: chunk index - nslots included

        if need > 0:
            self._wait_consumed(need, f"chunk {need - 1} (to free a slot for chunk {index})")
        return self.memory.slot(index % nslots)

    def drained(self) -> None:
        """Wait until every worker consumed the whole round: a worker may return from its
        update first and receive on a thread (``receives_after_return``, vLLM's staged rounds)."""
        if self.total:
            self._wait_consumed(self.total, f"the round's last chunk ({self.total - 1})")

    def _wait_consumed(self, need: int, what: str) -> None:
        def check() -> None:
            call = self.call
            if call is None or not call.done():
                return
            if call.error is not None:
                raise call.error
            # Every worker returned; one still receiving on a thread may since have died.
            world = min(self.memory.ack(0).world_size, MAX_RECEIVERS)
            for rank in range(world):
                ack = self.memory.ack(rank)
                behind = ack.token == self.first and ack.consumed < need
                if behind and not self.memory.reader_alive(rank):
                    raise TransferError(
                        f"ipc ring {self.memory.name}: receiver rank {rank} closed the ring "
                        f"or its process exited after {ack.consumed} of {self.total} chunks"
                    )

        with self.stats.phase("wire"):
            wait_until(
                lambda: self.consumed(self.published) >= need,
                timeout_s=self.timeout_s,
                check=check,
                what=f"every worker consuming {what}",
            )

    def put(self, nbytes: int, filled: torch.Tensor) -> None:
        """Publish a bucket: packed in its slot, or (larger than a slot) copied chunk by chunk."""
        for start, length in chunks(nbytes, self.memory.capacity):
            if nbytes > self.memory.capacity:
                slot = self.free_slot()
                with self.stats.phase("pack"):
                    slot[:length].copy_(filled[start : start + length])
            at = self.published % self.memory.num_slots
            self.memory.publish(at, self.first + self.published, length)  # seq last: commits
            self.published += 1

    def cancel(self) -> None:
        if self.published < self.total:
            at = self.published % self.memory.num_slots
            self.memory.cancel(at, self.first + self.published)


class IPCTrainerEngine(BucketedTrainerEngine):
    """Stages buckets in shared memory (CPU) or exported GPU buffers (CUDA)."""

    init_info_cls = IPCTrainerInitInfo
    _memory: StagingSegment | CudaStaging | None = None
    _big: torch.Tensor | None = None
    _seq = 0

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    @property
    def segment_name(self) -> str | None:
        return self._memory.name if isinstance(self._memory, StagingSegment) else None

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None,
    ) -> None:
        super().__init__(init_info, client=client, source=source)
        assert isinstance(init_info, IPCTrainerInitInfo)  # the kit refuses any other
        self.ipc = init_info
        self._shm = init_info.transport == "shm"
        self._picked: Callable[[], None] | None = None  # shm: the round _prepare picked
        self._ring: _Ring | None = None  # shm: this round's ring, when it goes through one
        self._considered: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # What this engine shared, with the model's first tensor (gone from it: the model left)
        self._owned: list[tuple[SharedWeights, weakref.ref[torch.Tensor]]] = []
        # The round's ModuleSource, unwrapped (_prepare sees it wrapped, if at all)
        self._module_source: ModuleSource | None = None

    def send_weights(
        self,
        source: WeightSource | None = None,
        *,
        weight_version: str | None = None,
        verify: bool = False,
    ) -> TransferStats:
        src = source if source is not None else self.source
        self._module_source = src if isinstance(src, ModuleSource) else None
        try:
            return super().send_weights(source, weight_version=weight_version, verify=verify)
        finally:
            self._module_source = None

    def _share_once(self, source: ModuleSource, stats: TransferStats) -> None:
        """Move ``source``'s model into shared memory, once per model, where that is safe."""
        info = self.ipc
        module = source.module
        if not info.share_weights or module in self._considered:
            return  # (only the sender's shm path calls this)
        self._considered.add(module)
        named: list[tuple[str, torch.Tensor]] = list(module.named_parameters())  # the objects
        if source.include_buffers:
            named += list(module.named_buffers())
        if not named or any(locate(t) is not None for _, t in named):
            return  # nothing to move, or the caller shared it (share_weights) already
        reason = why_not_movable(named)
        if reason is not None:
            log.info("ipc: the model stays where it is, rounds go through the ring: %s", reason)
            return
        try:
            with stats.phase("pack"):  # the move is a copy of its own, in the round's time
                shared = share_weights(dict(named))
            self._owned.append((shared, weakref.ref(named[0][1])))
        except TransferError as e:  # the kernel refused the memory: the ring still works
            log.warning(
                "ipc: could not move the model into shared memory (%s); rounds go through the ring",
                e,
            )

    def _close_abandoned(self) -> None:
        """Close shared weights whose model has left them (``model.half()``), which would
        otherwise hold the model's old bytes until shutdown."""
        kept = []
        for shared, first in self._owned:
            t = first()
            if t is not None and (t.numel() == 0 or shared.offset_of(t) is not None):
                kept.append((shared, first))
            else:
                shared.close()
        self._owned = kept

    def shutdown(self) -> None:
        super().shutdown()
        while self._owned:
            self._owned.pop()[0].close()

    def worker_init_info(self) -> dict[str, Any]:
        info = self.ipc
        return asdict(
            IPCInitInfo(
                transport=info.transport,
                packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes,
                packed_num_buffers=info.packed_num_buffers,
                timeout_s=info.timeout_s,
            )
        )

    def allocate_staging(self, capacity: int, count: int) -> list[torch.Tensor]:
        info = self.ipc
        if info.transport == "shm":
            self._memory = StagingSegment(capacity, count)
        else:
            from wtcore_ipc.cuda import CudaStaging

            self._memory = CudaStaging(capacity, count, info.device)
        return [self._memory.slot(i) for i in range(count)]

    def release_staging(self) -> None:
        """Close the segment, after the kit's slot views of it (so that it can be unmapped)."""
        memory, self._memory = self._memory, None
        self._big = None
        super().release_staging()
        if memory is not None:
            memory.close()

    def _oversized(self, nbytes: int) -> torch.Tensor:
        """The private buffer a tensor larger than a slot is packed in (the ring stays fixed)."""
        import torch

        if self._big is None or self._big.numel() < nbytes:
            self._big = None
            self._big = torch.empty(nbytes, dtype=torch.uint8)
        return self._big

    def fill(
        self,
        source: WeightSource,
        metas: list[ParamMeta],
        buckets: list[Bucket],
        slots: list[torch.Tensor],
        stats: TransferStats,
    ) -> Iterator[tuple[Bucket, Any]]:
        """``shm``: pack into the next free slot, or a bigger bucket in :meth:`_oversized`."""
        ring = self._ring
        if ring is None:
            return super().fill(source, metas, buckets, slots, stats)

        def buffer_for(bucket: Bucket) -> torch.Tensor:
            if bucket.nbytes <= ring.memory.capacity:
                return ring.free_slot()
            return self._oversized(bucket.nbytes)

        return pack_source(source, metas, buckets, buffer_for, stats)

    def begin_round(self, metas: list[ParamMeta], buckets: list[Bucket]) -> None:
        """``shm``: the round's one ``update_weights`` goes out first, on a helper thread."""
        super().begin_round(metas, buckets)
        ring = self._ring
        if ring is None:
            return
        assert self.client is not None, "the sender always has a client"
        payload = {
            **BucketUpdateInfo.wire(metas),
            "segment": ring.memory.name,
            "segment_fd": ring.memory.fd,
            "seq": ring.first,
            "num_slots": ring.memory.num_slots,
            "slot_bytes": ring.memory.capacity,
        }
        self._inflight = ring.call = BackgroundCall(
            self.client.update_weights, payload, name="update_weights"
        )

    def send_bucket(self, bucket: Bucket, filled: torch.Tensor, slot: int) -> dict[str, Any] | None:
        if self._ring is not None:
            self._ring.put(bucket.nbytes, filled)
            return None
        memory = self._memory
        assert memory is not None and not isinstance(memory, StagingSegment)
        self._seq += 1
        memory.publish(slot)
        return {
            **BucketUpdateInfo.wire(bucket.metas),
            "sizes": [m.nbytes for m in bucket.metas],
            "length": bucket.nbytes,
            "seq": self._seq,
            "offset": 0,
            "cuda": dict(memory.handles[slot]),
        }

    def end_round(self, stats: TransferStats) -> None:
        if self._ring is not None:
            self._ring.drained()
        super().end_round(stats)

    def abandon_round(self) -> None:
        if self._ring is not None:
            self._ring.cancel()

    def _prepare(self, source: WeightSource, stats: TransferStats) -> None:
        """``shm``: share the model (once), then the source's first tensor picks the round:
        out of shared weights or through the ring."""
        self._ring = None
        if not self._shm:
            super()._prepare(source, stats)
            return
        self._close_abandoned()
        if self._module_source is not None:
            self._share_once(self._module_source, stats)
        metas = source.metadata()
        items = iter_checked(source, metas)
        first = next(items, None)
        found = locate(first[1]) if first is not None else None
        if found is not None and first is not None:
            shared, offsets = found[0], self._offsets_in(found[0], found[1], items)
            if offsets is not None:
                self._picked = lambda: self._send_shared(shared, metas, offsets, stats)
                return
            # else a second pass: a source whose tensors are in shared memory is a local one
        elif first is not None:
            source = _Resumed(source, (first[0].name, first[1]), items)
        self.staging(self.info.packed_buffer_size_bytes)
        memory = self._memory
        assert isinstance(memory, StagingSegment)
        buckets = self.info.plan(metas)
        total = sum(len(chunks(b.nbytes, memory.capacity)) for b in buckets)
        self._ring = _Ring(memory, self._seq + 1, total, self.info.timeout_s, stats)
        self._seq += total
        self._planned = metas, buckets
        send = super()._send  # the kit's loop, with the ring's hooks
        self._picked = lambda: send(source, stats)

    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        if not self._shm:
            super()._send(source, stats)
            return
        send, self._picked = self._picked, None
        assert send is not None, "_prepare picked the round"
        send()

    def _offsets_in(
        self, shared: SharedWeights, offset: int, items: Iterator[Any]
    ) -> list[int] | None:
        """Every tensor's offset in ``shared``, or ``None`` (with a warning) when one was
        replaced since :func:`share_weights`: that round goes through the ring."""
        offsets = [offset]
        for meta, t in items:
            off = shared.offset_of(t)
            if off is None:
                warnings.warn(
                    f"ipc: {meta.name!r} is no longer in the shared weights of segment "
                    f"{shared.name} (replaced since share_weights?); this round is copied "
                    "through the ring. Call share_weights again to send without copies.",
                    RuntimeWarning,
                    stacklevel=5,
                )
                return None
            offsets.append(off)
        return offsets

    def _send_shared(
        self,
        shared: SharedWeights,
        metas: list[ParamMeta],
        offsets: list[int],
        stats: TransferStats,
    ) -> None:
        assert self.client is not None, "the sender always has a client"
        segment = shared.segment
        assert segment is not None
        stats.num_tensors = len(metas)
        stats.num_bytes = sum(m.nbytes for m in metas)
        self._seq += 1
        seq = self._seq
        segment.publish(0, seq, shared.nbytes)  # what a worker checks before and after copying
        try:
            self.begin_round(metas, [])
            payload = {
                **BucketUpdateInfo.wire(metas),
                "segment": segment.name,
                "segment_fd": segment.fd,
                "seq": seq,
                "offsets": offsets,
            }
            with stats.phase("wire"):
                self.client.update_weights(payload)
            stats.num_buckets = 1
            self.end_round(stats)
        except BaseException:
            # A worker still copying (this call timed out) must not report weights the
            # trainer goes on to change: it re-reads the header after its copy.
            segment.publish(0, seq, CANCELLED)
            raise
