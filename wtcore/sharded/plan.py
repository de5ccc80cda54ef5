"""One plan for sharded transfer: which bytes go from which sending rank to which receiving rank.

Why one planner in the core: the field's sharded backends move each trainer rank's shard
straight to the inference ranks that need it, and the hard part is not the moving but agreeing
on it. Both ends run this planner on the same inputs (the metadata and the layouts of
:mod:`wtcore.sharded.layout`) and compare their digest, so a receiver never waits for bytes
the sender did not plan to send, and never applies bytes it did not plan to receive.

The plan intersects what each sending rank holds with what each receiving rank needs. The
global index space is cut into cells at every box boundary of either side, so each cell lies
wholly inside or outside every box; each cell a receiver needs goes to it from exactly one of
the senders that hold it (spread over the holders by receiving rank, for replicated tensors).
Each rank computes only its own part: a trainer rank the cells it holds that a receiver
needs, a receiver the cells of its own box. A cell no sender holds is a gap, a
:class:`~wtcore.errors.PayloadError` naming the tensor and the region, raised by the
receiver that needs it before anything moves; a receiver's part is then proved,
independently of how it was built (:func:`check_coverage`): every element of its box is
covered by exactly one chunk.

Chunks are ordered by (sender, receiver) pair, then by tensor, so each pair's chunks can be
packed into buckets in the same order on both ends. Regions in a chunk are in each rank's own
local coordinates (its box's start is 0).
"""

from __future__ import annotations

import gc
import hashlib
import json
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any, NamedTuple

from wtcore.errors import PayloadError
from wtcore.sharded.layout import Box, Layout, is_int, volume

if TYPE_CHECKING:
    from wtcore.meta import ParamMeta

__all__ = [
    "MAX_CHUNKS",
    "PLANNER",
    "Chunk",
    "Plan",
    "PlannedRound",
    "check_coverage",
    "check_digest",
    "plan_tensor",
    "plan_transfer",
]

#: The most chunks one round's plan may have: layouts from a peer with many box boundaries
#: cannot make a receiver spend unbounded time and memory planning.
MAX_CHUNKS = 1 << 20
#: The planner's rules, in the digest: ends that would cut the same inputs differently disagree.
PLANNER = "wtcore.plan/2"


class Chunk(NamedTuple):
    """One region of one tensor from sending rank ``src`` to receiving rank ``dst``.

    ``src_box`` is in the sender's local coordinates, ``dst_box`` in the receiver's. A tuple:
    a rank of a large round builds hundreds of thousands of them.
    """

    name: str
    src: int
    dst: int
    src_box: Box
    dst_box: Box
    nbytes: int


def _box_str(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _shift(cell: Box, origin: Box) -> Box:
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(cell, origin, strict=True))


def _meet(a: Box, b: Box) -> Box:
    return tuple((max(x, u), min(y, v)) for (x, y), (u, v) in zip(a, b, strict=True))


def _inside(cell: Box, box: Box) -> bool:
    return all(o <= a and b <= e for (a, b), (o, e) in zip(cell, box, strict=True))


def _grid(src: Layout, dst: Layout) -> tuple[list[list[int]], list[list[int]], int]:
    """The cuts of each dimension (every box boundary of either side), which senders hold each
    interval between them as a bit mask (a cell's holders are the AND of its intervals'), and
    the mask of every sender that holds anything."""
    cuts, held_by = [], []
    for d, size in enumerate(src.shape):
        points = {0, size}
        for box in (*src.boxes, *dst.boxes):
            if box is not None:
                points.update(box[d])
        c = sorted(points)
        # Each sender toggles its bit where its box starts and ends; a running XOR gives the
        # mask of every interval in one pass (linear in senders and cuts, whatever peers send).
        toggles: dict[int, int] = {}
        for s, box in enumerate(src.boxes):
            if box is not None and box[d][0] < box[d][1]:
                toggles[box[d][0]] = toggles.get(box[d][0], 0) ^ (1 << s)
                toggles[box[d][1]] = toggles.get(box[d][1], 0) ^ (1 << s)
        masks, running = [], 0
        for a in c[:-1]:
            running ^= toggles.get(a, 0)
            masks.append(running)
        cuts.append(c)
        held_by.append(masks)
    everyone = sum(1 << s for s, box in enumerate(src.boxes) if box is not None)
    return cuts, held_by, everyone


def plan_tensor(
    name: str,
    itemsize: int,
    src: Layout,
    dst: Layout,
    *,
    src_rank: int | None = None,
    dst_rank: int | None = None,
    limit: int = MAX_CHUNKS,
) -> list[Chunk]:
    """The chunks of one tensor from sending rank ``src_rank`` and to receiving rank
    ``dst_rank`` (``None``: every rank), computing only the cells those ranks share: a
    ``PayloadError`` if the shapes differ, a needed region is held by no sender, or the
    ranks' parts would be cut into more than ``limit`` cells. Without ``src_rank``, each
    receiver's part is proved covered exactly once (:func:`check_coverage`)."""
    if src.shape != dst.shape:
        raise PayloadError(
            f"{name!r}: the senders' layout is of shape {list(src.shape)}, the receivers' of "
            f"{list(dst.shape)}"
        )
    held = None if src_rank is None else src.boxes[src_rank]
    if src_rank is not None and held is None:
        return []
    receivers = range(dst.world_size) if dst_rank is None else range(dst_rank, dst_rank + 1)
    cuts, held_by, everyone = _grid(src, dst)
    wanted: list[tuple[int, Box, list[range]]] = []
    cells = 0
    for r in receivers:
        need = dst.boxes[r]
        if need is None:
            continue
        area = need if held is None else _meet(need, held)
        if any(lo >= hi for lo, hi in area):
            continue
        spans = [
            range(bisect_left(c, lo), bisect_left(c, hi))
            for c, (lo, hi) in zip(cuts, area, strict=True)
        ]
        n = 1
        for span in spans:
            n *= len(span)
        cells += n
        if cells > limit:  # counted before any cell is built
            raise PayloadError(
                f"{name!r}: the layouts cut this tensor into more than {limit} chunks"
            )
        wanted.append((r, need, spans))
    chunks: list[Chunk] = []
    for r, need, spans in wanted:
        for index in product(*spans):
            cell = tuple((c[i], c[i + 1]) for c, i in zip(cuts, index, strict=True))
            mask = everyone
            for masks, i in zip(held_by, index, strict=True):
                mask &= masks[i]
            if not mask:
                raise PayloadError(
                    f"{name!r}: region {_box_str(cell)} of receiving rank {r} is held by no "
                    "sending rank (a gap in the senders' layout)"
                )
            for _ in range(r % mask.bit_count()):  # holder number r mod count, lowest first
                mask &= mask - 1
            s = (mask & -mask).bit_length() - 1
            if src_rank is not None and s != src_rank:
                continue
            origin = src.boxes[s]
            assert origin is not None
            chunks.append(
                Chunk(name, s, r, _shift(cell, origin), _shift(cell, need), volume(cell) * itemsize)
            )
    if src_rank is None:
        check_coverage(name, chunks, dst, itemsize, ranks=receivers)
    return chunks


def check_coverage(
    name: str, chunks: Sequence[Chunk], dst: Layout, itemsize: int, *, ranks: Iterable[int] = ()
) -> None:
    """Prove every element of the box of every receiver in ``ranks`` (default: all) is
    covered by exactly one chunk.

    Chunks of one receiver must lie inside its box, be pairwise disjoint and add up to its
    volume; otherwise a ``PayloadError`` names the tensor, the rank and the region.
    """
    mine: dict[int, list[Chunk]] = {}
    for c in chunks:
        if not 0 <= c.dst < dst.world_size or dst.boxes[c.dst] is None:
            raise PayloadError(f"{name!r}: a chunk for receiving rank {c.dst}, which needs none")
        mine.setdefault(c.dst, []).append(c)
    for r in ranks or range(dst.world_size):
        need = dst.boxes[r]
        if need is None:
            continue
        local = tuple((0, b - a) for a, b in need)
        got = mine.get(r, [])
        for c in got:
            if not _inside(c.dst_box, local):
                raise PayloadError(
                    f"{name!r}: region {_box_str(c.dst_box)} lies outside receiving rank {r}'s "
                    f"part {_box_str(local)}"
                )
            if c.nbytes != volume(c.dst_box) * itemsize:
                raise PayloadError(
                    f"{name!r}: a chunk of {c.nbytes} bytes for region {_box_str(c.dst_box)}"
                )
        # Pairwise disjoint, by a sweep along the first dimension: a chunk is compared only
        # with those still open where it starts (one band of a grid, not all of them).
        active: list[Chunk] = []
        for c in sorted(got, key=lambda c: c.dst_box[0] if c.dst_box else (0, 0)):
            start = c.dst_box[0][0] if c.dst_box else 0
            active = [o for o in active if not o.dst_box or o.dst_box[0][1] > start]
            for other in active:
                both = tuple(
                    (max(a, x), min(b, y))
                    for (a, b), (x, y) in zip(c.dst_box, other.dst_box, strict=True)
                )
                if all(a < b for a, b in both):
                    raise PayloadError(
                        f"{name!r}: region {_box_str(both)} of receiving rank {r} is covered twice"
                    )
            active.append(c)
        covered = sum(volume(c.dst_box) for c in got)
        if covered != volume(need):
            raise PayloadError(
                f"{name!r}: {volume(need) - covered} of the {volume(need)} elements of "
                f"receiving rank {r}'s part {_box_str(need)} are covered by no chunk"
            )


class Plan:
    """A round's plan: each tensor's metadata, the senders' layout and the receivers'.

    Nothing is planned up front: each rank asks for its own part (``src=`` a trainer rank,
    ``dst=`` a receiver; neither: every chunk) and only the cells it touches are computed,
    once per distinct pair of layouts (a model's layers share them).
    """

    def __init__(self, tensors: Sequence[tuple[ParamMeta, Layout, Layout]]) -> None:
        for meta, src, _ in tensors:
            if tuple(meta.shape) != src.shape:
                raise PayloadError(
                    f"{meta.name!r}: metadata of shape {list(meta.shape)}, layout of shape "
                    f"{list(src.shape)}"
                )
        self.tensors = tuple(tensors)
        self._parts: dict[tuple[int | None, int | None], dict[tuple[int, int], list[Chunk]]] = {}

    def _part(self, src: int | None, dst: int | None) -> dict[tuple[int, int], list[Chunk]]:
        """A part holding every chunk from ``src`` to ``dst`` (``None``: any), by pair: one
        already planned, else this one, planned now."""
        for key in ((src, dst), (src, None), (None, dst), (None, None)):
            if key in self._parts:
                return self._parts[key]
        # A part may be hundreds of thousands of chunks: a collection midway would scan them
        # all, and every object of the process, again and again (half the time, measured).
        collecting = gc.isenabled()
        gc.disable()
        try:
            done: dict[tuple[Layout, Layout], list[Chunk]] = {}
            out: dict[tuple[int, int], list[Chunk]] = {}
            left = MAX_CHUNKS
            for meta, src_layout, dst_layout in self.tensors:
                cells = done.get((src_layout, dst_layout))
                if cells is None:  # the cells of a pair of layouts, in elements
                    cells = done[(src_layout, dst_layout)] = plan_tensor(
                        meta.name, 1, src_layout, dst_layout, src_rank=src, dst_rank=dst, limit=left
                    )
                left -= len(cells)
                if left < 0:
                    raise PayloadError(
                        f"the layouts cut this round into more than {MAX_CHUNKS} chunks"
                    )
                name, n = meta.name, meta.dtype.itemsize
                for _, s, d, a, b, v in cells:
                    into = out.get((s, d))
                    if into is None:
                        into = out[(s, d)] = []
                    into.append(Chunk(name, s, d, a, b, v * n))
        finally:
            if collecting:
                gc.enable()
        self._parts[(src, dst)] = part = {p: out[p] for p in sorted(out)}
        return part

    def select(self, *, src: int | None = None, dst: int | None = None) -> list[Chunk]:
        """The chunks from ``src`` and/or to ``dst`` (``None``: every rank), in order."""
        return [c for p in self.pairs(src=src, dst=dst) for c in self._part(src, dst)[p]]

    def pair(self, src: int, dst: int) -> list[Chunk]:
        """The chunks ``src`` sends ``dst``, in the order both ends pack them."""
        return self._part(src, dst).get((src, dst), [])

    def pairs(self, *, src: int | None = None, dst: int | None = None) -> list[tuple[int, int]]:
        """The (sender, receiver) pairs that exchange anything, from ``src`` and/or to ``dst``."""
        return [p for p in self._part(src, dst) if src in (None, p[0]) and dst in (None, p[1])]

    def nbytes(self, *, src: int | None = None, dst: int | None = None) -> int:
        """Bytes planned, optionally only from ``src`` and/or only to ``dst``."""
        return sum(c.nbytes for c in self.select(src=src, dst=dst))

    def to_wire(self) -> dict[str, Any]:
        """The inputs, JSON-safe: the metadata, each distinct layout once, and each tensor's
        senders' and receivers' layout as an index into them."""
        from wtcore.meta import metas_to_wire

        index: dict[Layout, int] = {}
        senders = [index.setdefault(s, len(index)) for _, s, _ in self.tensors]
        receivers = [index.setdefault(d, len(index)) for _, _, d in self.tensors]
        return {
            **metas_to_wire([m for m, _, _ in self.tensors]),
            "layouts": [lay.to_wire() for lay in index],
            "senders": senders,
            "receivers": receivers,
        }

    def digest(self) -> str:
        """``"sha256:<hex>"`` of the planner's version and the inputs, from which every rank
        derives the same plan: both ends (and the trainer ranks) compare it before a round."""
        raw = json.dumps([PLANNER, self.to_wire()], separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(raw).hexdigest()


def plan_transfer(tensors: Sequence[tuple[ParamMeta, Layout, Layout]]) -> Plan:
    """The plan of a round: each tensor's metadata, the senders' layout, the receivers'."""
    return Plan(tensors)


def check_digest(ours: str, theirs: object, *, peer: str) -> None:
    """Refuse a round whose plan differs between the ends, naming both digests."""
    if theirs != ours:
        raise PayloadError(
            f"plan digest: {peer} planned {theirs!r:.80}, this side planned {ours!r}; the two "
            "ends disagree on the layouts (refused before any byte moved)"
        )


@dataclass(frozen=True)
class PlannedRound:
    """A round's plan with everything a receiver needs to recompute it.

    The trainer sends :meth:`to_wire` once per round; a receiver decodes it with
    :meth:`from_wire`, which checks every field and refuses inputs whose digest differs from
    the trainer's, then plans its own part from them, so both ends move exactly the same
    chunks. ``senders`` and ``receivers`` hold one layout per tensor, in ``metas`` order.
    """

    metas: tuple[ParamMeta, ...]
    senders: tuple[Layout, ...]
    receivers: tuple[Layout, ...]
    plan: Plan = field(compare=False)  # what the inputs give

    @classmethod
    def make(
        cls,
        metas: Sequence[ParamMeta],
        senders: Mapping[str, Layout],
        receivers: Mapping[str, Layout],
    ) -> PlannedRound:
        src = tuple(senders[m.name] for m in metas)
        dst = tuple(receivers[m.name] for m in metas)
        plan = plan_transfer(list(zip(metas, src, dst, strict=True)))
        return cls(tuple(metas), src, dst, plan)

    def to_wire(self) -> dict[str, Any]:
        return {**self.plan.to_wire(), "digest": self.plan.digest()}

    @classmethod
    def from_wire(cls, data: object, *, field: str = "plan") -> PlannedRound:
        """Decode and check; errors name ``field``, a digest mismatch both digests."""
        from wtcore.meta import metas_from_wire

        if not isinstance(data, Mapping):
            raise PayloadError(f"{field}: expected an object, got {type(data).__name__}")
        keys = {"names", "dtype_names", "shapes", "layouts", "senders", "receivers", "digest"}
        if set(data) != keys:
            odd = sorted(set(data) ^ keys)
            raise PayloadError(f"{field}: missing or unknown field {odd[0]!r:.40}")
        try:
            metas = metas_from_wire(data["names"], data["dtype_names"], data["shapes"])
        except PayloadError as e:
            raise PayloadError(f"{field}.{e}") from e
        wire = data["layouts"]
        if not isinstance(wire, list) or len(wire) > 2 * len(metas):
            raise PayloadError(f"{field}.layouts: expected a list of at most two per tensor")
        layouts = [Layout.from_wire(w, field=f"{field}.layouts[{i}]") for i, w in enumerate(wire)]
        sides: list[tuple[Layout, ...]] = []
        for side in ("senders", "receivers"):
            index = data[side]
            if not isinstance(index, list) or len(index) != len(metas):
                raise PayloadError(f"{field}.{side}: expected one layout index per tensor")
            for i, k in enumerate(index):
                if not is_int(k) or not 0 <= k < len(layouts):
                    raise PayloadError(
                        f"{field}.{side}[{i}]: expected a layout index, got {k!r:.40}"
                    )
                if layouts[k].shape != tuple(metas[i].shape):
                    raise PayloadError(
                        f"{field}.{side}[{i}]: the layout of {metas[i].name!r} is not of its shape"
                    )
            sides.append(tuple(layouts[k] for k in index))
        senders, receivers = sides
        plan = plan_transfer(list(zip(metas, senders, receivers, strict=True)))
        check_digest(plan.digest(), data["digest"], peer="the trainer")
        return cls(tuple(metas), senders, receivers, plan)
