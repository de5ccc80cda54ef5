"""A plan's (sender, receiver) pairs as buckets: packed by a sender, assembled by a receiver.

Why buckets again: a pair's chunks are many small regions, and every engine already moves
buckets well. Each chunk is a tensor of its region's shape for :mod:`wtcore.buckets`, so both
ends cut a pair into buckets by the one bucket rule and only bytes travel. A receiver
(:class:`PairAssembler`) takes a pair's buckets in order, checks each one's size before it
writes a byte, writes every chunk into its region of the receiver's own part (in place where
the sink offers the tensor, else in a buffer handed to the sink once the part is whole), and
counts what landed against the plan: a round with a bucket or a byte missing is refused at
finish, naming the tensors and the senders.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.buckets import Bucket, pack_bucket, plan_buckets, unpack_bucket
from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.parse import parse_dataclass
from wtcore.sharded.layout import region
from wtcore.sharded.plan import PlannedRound
from wtcore.sink import WeightSink, direct_destination

if TYPE_CHECKING:
    import torch

    from wtcore.sharded.layout import Box
    from wtcore.sharded.plan import Chunk
    from wtcore.sharded.receiver_layout import TPLayout

__all__ = ["PairAssembler", "PlanReceiver", "PlanUpdate", "pack_pair", "pair_buckets"]


def _extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def pair_buckets(
    planned: PlannedRound, src: int, dst: int, buffer_size_bytes: int
) -> list[tuple[Bucket, list[Chunk]]]:
    """The buckets of pair (``src``, ``dst``), each with its chunks, as both ends cut them."""
    dtypes = {m.name: m.dtype for m in planned.metas}
    chunks = planned.plan.pair(src, dst)
    metas = [ParamMeta(c.name, dtypes[c.name], _extents(c.src_box)) for c in chunks]
    out, at = [], 0
    for bucket in plan_buckets(metas, buffer_size_bytes):
        out.append((bucket, chunks[at : at + len(bucket.metas)]))
        at += len(bucket.metas)
    return out


def pack_pair(
    bucket: Bucket, chunks: Sequence[Chunk], local: Mapping[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Pack ``chunks``' regions of this sender's own parts ``local`` into ``out``."""
    parts = []
    for c in chunks:
        part = local.get(c.name)
        if part is None:
            raise PayloadError(f"{c.name!r}: this sending rank holds no part of it")
        parts.append(region(part, c.src_box))  # strided: pack_bucket copies it in place
    return pack_bucket(bucket, parts, out)


class PairAssembler:
    """One receiver's side of a planned round: takes each sender's buckets, in order."""

    def __init__(
        self,
        planned: PlannedRound,
        rank: int,
        buffer_size_bytes: int,
        sink: WeightSink,
        device: str = "cpu",
    ) -> None:
        self.rank = rank
        #: The round's plan, every pair's (an engine may schedule all pairs together).
        self.planned = planned
        #: How many trainer ranks the plan has.
        self.trainer_ranks = planned.senders[0].world_size if planned.senders else 0
        self.sink = sink
        self.device = device
        plan = planned.plan
        self._buckets = {
            s: pair_buckets(planned, s, rank, buffer_size_bytes) for s, _ in plan.pairs(dst=rank)
        }
        self._next = dict.fromkeys(self._buckets, 0)
        #: This receiver's part of each tensor it gets, as its sink sees it.
        gets = {c.name for c in plan.select(dst=rank)}
        self.metas = [
            ParamMeta(m.name, m.dtype, lay.local_shape(rank))
            for m, lay in zip(planned.metas, planned.receivers, strict=True)
            if m.name in gets
        ]
        self._shapes = {m.name: m.shape for m in self.metas}
        self._left = {m.name: m.nbytes for m in self.metas}
        self._planned = dict(self._left)
        self._targets: dict[str, tuple[torch.Tensor, bool]] = {}

    @classmethod
    def for_receiver(
        cls,
        planned: PlannedRound,
        *,
        rank: int,
        world_size: int,
        layout: TPLayout | None,
        buffer_size_bytes: int,
        sink: WeightSink,
        device: str = "cpu",
    ) -> PairAssembler:
        """Receiver ``rank`` of ``world_size``'s side of ``planned`` (as decoded from the wire:
        re-planned and checked), its boxes checked against what it holds (``layout``;
        ``None``: whole tensors): a round planned for another layout is refused before a
        byte is applied."""
        for i, (meta, lay) in enumerate(zip(planned.metas, planned.receivers, strict=True)):
            if lay.world_size != world_size:
                raise PayloadError(
                    f"update_info.plan.receivers[{i}]: planned for {lay.world_size} receivers, "
                    f"this one is rank {rank} of {world_size}"
                )
            want = (
                tuple((0, d) for d in meta.shape)
                if layout is None
                else layout.box(meta.name, meta.shape)
            )
            if lay.boxes[rank] != want:
                raise PayloadError(
                    f"update_info.plan.receivers[{i}]: {meta.name!r} was planned as "
                    f"{lay.boxes[rank]} for receiver {rank}, which holds {want}"
                )
        return cls(planned, rank, buffer_size_bytes, sink, device)

    def senders(self) -> list[int]:
        """The sending ranks this receiver gets anything from."""
        return list(self._buckets)

    def buckets_from(self, src: int) -> list[tuple[Bucket, list[Chunk]]]:
        """Sending rank ``src``'s buckets for this receiver, in order, with their chunks."""
        return self._buckets[src]

    def take(self, items: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Apply buckets, each ``(src, index, data)`` (``data`` a flat ``uint8`` tensor).

        All of them are checked first (each sender's next bucket, in order, of its planned
        size), so a bad one leaves this call's buckets unapplied.
        """
        nexts = dict(self._next)
        for src, index, data in items:
            buckets = self._buckets.get(src)
            if buckets is None:
                raise PayloadError(
                    f"src: sending rank {src!r} has nothing for receiver {self.rank}"
                )
            if index != nexts[src] or index >= len(buckets):
                raise PayloadError(
                    f"bucket: expected bucket {nexts[src]} of sending rank {src}, got "
                    f"{index!r} ({len(buckets)} planned)"
                )
            if data.numel() != buckets[index][0].nbytes:
                raise PayloadError(
                    f"data: bucket {index} of sending rank {src} holds "
                    f"{buckets[index][0].nbytes} bytes, got {data.numel()}"
                )
            nexts[src] = index + 1
        import torch

        with torch.no_grad():
            for src, index, data in items:
                bucket, chunks = self._buckets[src][index]
                for c, (_, view) in zip(chunks, unpack_bucket(bucket, data), strict=True):
                    target, _ = self._target(c.name, view.dtype)
                    region(target, c.dst_box).copy_(view)
                    self._landed(c)
                self._next[src] = index + 1

    def _target(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        got = self._targets.get(name)
        if got is None:
            import torch

            shape = self._shapes[name]
            t = direct_destination(self.sink, name, dtype, shape, self.device)
            got = (t, True) if t is not None else (torch.empty(shape, dtype=dtype), False)
            self._targets[name] = got
        return got

    def _landed(self, c: Chunk) -> None:
        self._left[c.name] -= c.nbytes
        if self._left[c.name] == 0:
            t, in_place = self._targets.pop(c.name)
            if not in_place:
                self.sink.load_weights([(c.name, t)])

    def missing(self) -> Iterator[str]:
        """What has not landed yet, one line per sender and per tensor."""
        for s, buckets in self._buckets.items():
            if self._next[s] < len(buckets):
                yield f"sending rank {s}: {len(buckets) - self._next[s]} of {len(buckets)} buckets"
        for name, left in self._left.items():
            if left:
                yield f"{name!r} ({self._planned[name] - left} of {self._planned[name]} bytes)"

    def check_complete(self) -> None:
        """Refuse a round in which any planned byte for this receiver did not land."""
        missing = list(self.missing())
        if missing:
            shown = "; ".join(missing[:6]) + ("; ..." if len(missing) > 6 else "")
            raise PayloadError(
                f"round incomplete on receiver {self.rank}: {shown}; the round is not published"
            )


@dataclass
class PlanUpdate:
    """A sharded round's first update: its plan (:class:`~wtcore.sharded.plan.PlannedRound` on the
    wire); :meth:`PlanReceiver.parse_plan` attaches this receiver's assembler."""

    plan: dict[str, Any]

    def __post_init__(self) -> None:
        self.assembler: PairAssembler | None = None
        #: This receiver's parts, for the worker's byte ledger.
        self.metas: list[ParamMeta] = []


class PlanReceiver:
    """What every worker engine that executes sharded plans does the same way (a mixin for a
    :class:`~wtcore.engine.WeightTransferEngine`): take the plan as the round's first update,
    refuse whole-tensor updates and a second plan in that round, and refuse to finish it
    while a planned byte is missing. The engine moves the pairs' buckets and hands them to
    :meth:`planned`'s :meth:`PairAssembler.take`."""

    _assembler: PairAssembler | None = None

    def plan_buffer_size_bytes(self) -> int:
        """The bucket size both ends cut pairs by (the engine's, as its init announced)."""
        raise NotImplementedError

    def parse_plan(self, data: object) -> PlanUpdate | None:
        """``data`` as a :class:`PlanUpdate` if it is one (``{"plan": ...}``), else None."""
        if not (isinstance(data, Mapping) and "plan" in data):
            return None
        info = parse_dataclass(PlanUpdate, data, what="update_info")
        engine: Any = self
        planned = PlannedRound.from_wire(info.plan, field="update_info.plan")
        info.assembler = PairAssembler.for_receiver(
            planned,
            rank=engine.rank,
            world_size=engine.world_size,
            layout=engine.receiver_layout,
            buffer_size_bytes=self.plan_buffer_size_bytes(),
            sink=engine.sink,
            device=str(engine.device),
        )
        info.metas = info.assembler.metas
        return info

    def take_plan(self, update: PlanUpdate) -> None:
        if self._assembler is not None:
            raise PayloadError("update_info.plan: this round already has its plan")
        self._assembler = update.assembler

    def planned(self, field: str) -> PairAssembler:
        """This round's assembler; a ``PayloadError`` naming ``field`` if no plan came."""
        if self._assembler is None:
            raise PayloadError(f"{field}: no plan was sent in this round")
        return self._assembler

    def refuse_whole_tensors(self) -> None:
        """Raise if this round is sharded (a whole-tensor update must not land in it)."""
        if self._assembler is not None:
            raise PayloadError(
                "update_info: this round is sharded (its plan was sent); whole-tensor updates "
                "are refused in it"
            )

    def drop_plan(self) -> None:
        self._assembler = None

    def check_planned_round(self) -> None:
        """At finish: refuse the round if a planned byte did not land (and forget the plan)."""
        assembler, self._assembler = self._assembler, None
        if assembler is not None:
            assembler.check_complete()

    # A round's start and abort forget its plan; its finish refuses it short of the plan.
    def start_weight_update(self) -> None:
        self.drop_plan()
        super().start_weight_update()  # type: ignore[misc]

    def abort(self) -> None:
        self.drop_plan()
        super().abort()  # type: ignore[misc]

    def finish_weight_update(self) -> None:
        self.check_planned_round()
        super().finish_weight_update()  # type: ignore[misc]
