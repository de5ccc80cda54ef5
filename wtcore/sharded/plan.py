"""One plan for sharded transfer: which bytes go from which sending rank to which receiving rank.

Why one planner in the core: the field's sharded backends move each trainer rank's shard
straight to the inference ranks that need it, and the hard part is not the moving but agreeing
on it. Both ends run this planner on the same layouts (:mod:`wtcore.sharded.layout`) and compare the
plan's digest, so a receiver never waits for bytes the sender did not plan to send, and never
applies bytes it did not plan to receive.

The plan intersects what each sending rank holds with what each receiving rank needs. The
global index space is cut into cells at every box boundary of either side, so each cell lies
wholly inside or outside every box; each cell a receiver needs goes to it from exactly one of
the senders that hold it (spread over the holders by receiving rank, for replicated tensors).
A cell no sender holds is a gap, a :class:`~wtcore.errors.PayloadError` naming the tensor and
the region, raised before anything moves. The result is then proved, independently of how it
was built (:func:`check_coverage`): every element of every receiver's box is covered by
exactly one chunk.

Chunks are ordered by (sender, receiver) pair, then by tensor, so each pair's chunks can be
packed into buckets in the same order on both ends. Regions in a chunk are in each rank's own
local coordinates (its box's start is 0).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise, product
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.sharded.layout import Box, Layout, volume

if TYPE_CHECKING:
    from wtcore.meta import ParamMeta

__all__ = [
    "MAX_CHUNKS",
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


@dataclass(frozen=True)
class Chunk:
    """One region of one tensor from sending rank ``src`` to receiving rank ``dst``.

    ``src_box`` is in the sender's local coordinates, ``dst_box`` in the receiver's.
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


def _inside(cell: Box, box: Box) -> bool:
    return all(o <= a and b <= e for (a, b), (o, e) in zip(cell, box, strict=True))


def plan_tensor(
    name: str, itemsize: int, src: Layout, dst: Layout, *, limit: int = MAX_CHUNKS
) -> list[Chunk]:
    """The chunks of one tensor; ``PayloadError`` if the shapes differ, a needed region is
    held by no sender, or one receiver's part would be cut into more than ``limit`` chunks."""
    if src.shape != dst.shape:
        raise PayloadError(
            f"{name!r}: the senders' layout is of shape {list(src.shape)}, the receivers' of "
            f"{list(dst.shape)}"
        )
    cuts: list[list[int]] = []
    for d, size in enumerate(src.shape):
        points = {0, size}
        for box in (*src.boxes, *dst.boxes):
            if box is not None:
                points.update(box[d])
        cuts.append(sorted(points))
    # Which senders hold each interval between cuts, per dimension, as a bit mask: a cell's
    # holders are the AND of its intervals' masks (no scan over every sender per cell).
    # Each sender toggles its bit where its box starts and ends; a running XOR gives the mask
    # of every interval in one pass (linear in senders and cuts, whatever peers send).
    held_by: list[dict[tuple[int, int], int]] = []
    for d, c in enumerate(cuts):
        toggles: dict[int, int] = {}
        for s, box in enumerate(src.boxes):
            if box is not None and box[d][0] < box[d][1]:
                toggles[box[d][0]] = toggles.get(box[d][0], 0) ^ (1 << s)
                toggles[box[d][1]] = toggles.get(box[d][1], 0) ^ (1 << s)
        masks, running = {}, 0
        for a, b in pairwise(c):
            running ^= toggles.get(a, 0)
            masks[(a, b)] = running
        held_by.append(masks)
    everyone = sum(1 << s for s, box in enumerate(src.boxes) if box is not None)
    wanted: list[tuple[int, Box, list[list[tuple[int, int]]]]] = []
    cells = 0
    for r, need in enumerate(dst.boxes):
        if need is None or volume(need) == 0:
            continue
        spans = [
            [(a, b) for a, b in pairwise(c) if lo <= a and b <= hi]
            for c, (lo, hi) in zip(cuts, need, strict=True)
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
        for cell in product(*spans):
            mask = everyone
            for d, interval in enumerate(cell):
                mask &= held_by[d][interval]
            if not mask:
                raise PayloadError(
                    f"{name!r}: region {_box_str(cell)} of receiving rank {r} is held by no "
                    "sending rank (a gap in the senders' layout)"
                )
            for _ in range(r % mask.bit_count()):  # holder number r mod count, lowest first
                mask &= mask - 1
            s = (mask & -mask).bit_length() - 1
            held = src.boxes[s]
            assert held is not None
            chunks.append(
                Chunk(name, s, r, _shift(cell, held), _shift(cell, need), volume(cell) * itemsize)
            )
    check_coverage(name, chunks, dst, itemsize)
    return chunks


def check_coverage(name: str, chunks: Sequence[Chunk], dst: Layout, itemsize: int) -> None:
    """Prove every element of every receiver's box is covered by exactly one chunk.

    Chunks of one receiver must lie inside its box, be pairwise disjoint and add up to its
    volume; otherwise a ``PayloadError`` names the tensor, the rank and the region.
    """
    mine: dict[int, list[Chunk]] = {}
    for c in chunks:
        if not 0 <= c.dst < dst.world_size or dst.boxes[c.dst] is None:
            raise PayloadError(f"{name!r}: a chunk for receiving rank {c.dst}, which needs none")
        mine.setdefault(c.dst, []).append(c)
    for r, need in enumerate(dst.boxes):
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


@dataclass(frozen=True)
class Plan:
    """Every chunk of a round, ordered by (sender, receiver) pair, then tensor."""

    chunks: tuple[Chunk, ...]

    def pair(self, src: int, dst: int) -> list[Chunk]:
        """The chunks ``src`` sends ``dst``, in the order both ends pack them."""
        return [c for c in self.chunks if c.src == src and c.dst == dst]

    def pairs(self) -> list[tuple[int, int]]:
        """The (sender, receiver) pairs that exchange anything, in order."""
        return list(dict.fromkeys((c.src, c.dst) for c in self.chunks))

    def nbytes(self, *, src: int | None = None, dst: int | None = None) -> int:
        """Bytes planned, optionally only from ``src`` and/or only to ``dst``."""
        return sum(
            c.nbytes
            for c in self.chunks
            if (src is None or c.src == src) and (dst is None or c.dst == dst)
        )

    def digest(self) -> str:
        """``"sha256:<hex>"`` of the whole plan: both ends compare it at the handshake."""
        canon = [[c.name, c.src, c.dst, c.src_box, c.dst_box, c.nbytes] for c in self.chunks]
        raw = json.dumps(canon, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(raw).hexdigest()


def plan_transfer(tensors: Sequence[tuple[ParamMeta, Layout, Layout]]) -> Plan:
    """The plan of a round: each tensor's metadata, the senders' layout, the receivers'."""
    per_tensor: list[list[Chunk]] = []
    left = MAX_CHUNKS
    for meta, src, dst in tensors:
        if tuple(meta.shape) != src.shape:
            raise PayloadError(
                f"{meta.name!r}: metadata of shape {list(meta.shape)}, layout of shape "
                f"{list(src.shape)}"
            )
        per_tensor.append(plan_tensor(meta.name, meta.dtype.itemsize, src, dst, limit=left))
        left -= len(per_tensor[-1])
        if left < 0:
            raise PayloadError(f"the layouts cut this round into more than {MAX_CHUNKS} chunks")
    ranked = [
        (c.src, c.dst, t, i, c) for t, chunks in enumerate(per_tensor) for i, c in enumerate(chunks)
    ]
    ranked.sort(key=lambda x: x[:4])
    return Plan(tuple(x[4] for x in ranked))


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
    :meth:`from_wire`, which checks every field, plans again from the layouts and refuses a
    plan whose digest differs from the trainer's, so both ends move exactly the same chunks.
    ``senders`` and ``receivers`` hold one layout per tensor, in ``metas`` order.
    """

    metas: tuple[ParamMeta, ...]
    senders: tuple[Layout, ...]
    receivers: tuple[Layout, ...]
    plan: Plan

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
        from wtcore.meta import metas_to_wire

        return {
            **metas_to_wire(self.metas),
            "senders": [lay.to_wire() for lay in self.senders],
            "receivers": [lay.to_wire() for lay in self.receivers],
            "digest": self.plan.digest(),
        }

    @classmethod
    def from_wire(cls, data: object, *, field: str = "plan") -> PlannedRound:
        """Decode, check and plan again; errors name ``field``, a digest mismatch both."""
        from wtcore.meta import metas_from_wire

        if not isinstance(data, Mapping):
            raise PayloadError(f"{field}: expected an object, got {type(data).__name__}")
        keys = {"names", "dtype_names", "shapes", "senders", "receivers", "digest"}
        if set(data) != keys:
            odd = sorted(set(data) ^ keys)
            raise PayloadError(f"{field}: missing or unknown field {odd[0]!r:.40}")
        try:
            metas = metas_from_wire(data["names"], data["dtype_names"], data["shapes"])
        except PayloadError as e:
            raise PayloadError(f"{field}.{e}") from e
        sides: list[tuple[Layout, ...]] = []
        for side in ("senders", "receivers"):
            wire = data[side]
            if not isinstance(wire, list) or len(wire) != len(metas):
                raise PayloadError(f"{field}.{side}: expected one layout per tensor")
            sides.append(
                tuple(Layout.from_wire(w, field=f"{field}.{side}[{i}]") for i, w in enumerate(wire))
            )
        senders, receivers = sides
        for i, (m, s, d) in enumerate(zip(metas, senders, receivers, strict=True)):
            if s.shape != tuple(m.shape) or d.shape != tuple(m.shape):
                raise PayloadError(
                    f"{field}: the layouts of {m.name!r} (tensor {i}) are not of its shape"
                )
        plan = plan_transfer(list(zip(metas, senders, receivers, strict=True)))
        check_digest(plan.digest(), data["digest"], peer="the trainer")
        return cls(tuple(metas), senders, receivers, plan)
