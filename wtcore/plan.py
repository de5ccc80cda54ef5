"""One plan for sharded transfer: which bytes go from which sending rank to which receiving rank.

Why one planner in the core: the field's sharded backends move each trainer rank's shard
straight to the inference ranks that need it, and the hard part is not the moving but agreeing
on it. Both ends run this planner on the same layouts (:mod:`wtcore.layout`) and compare the
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
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise, product
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.layout import Box, Layout, volume

if TYPE_CHECKING:
    from wtcore.meta import ParamMeta

__all__ = ["Chunk", "Plan", "check_coverage", "check_digest", "plan_tensor", "plan_transfer"]


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


def plan_tensor(name: str, itemsize: int, src: Layout, dst: Layout) -> list[Chunk]:
    """The chunks of one tensor; ``PayloadError`` if the shapes differ or a needed region is
    held by no sender."""
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
    chunks: list[Chunk] = []
    for r, need in enumerate(dst.boxes):
        if need is None or volume(need) == 0:
            continue
        spans = [
            [(a, b) for a, b in pairwise(c) if lo <= a and b <= hi]
            for c, (lo, hi) in zip(cuts, need, strict=True)
        ]
        for cell in product(*spans):
            holders = [
                s for s, box in enumerate(src.boxes) if box is not None and _inside(cell, box)
            ]
            if not holders:
                raise PayloadError(
                    f"{name!r}: region {_box_str(cell)} of receiving rank {r} is held by no "
                    "sending rank (a gap in the senders' layout)"
                )
            s = holders[r % len(holders)]
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
        for i, c in enumerate(got):
            if not _inside(c.dst_box, local):
                raise PayloadError(
                    f"{name!r}: region {_box_str(c.dst_box)} lies outside receiving rank {r}'s "
                    f"part {_box_str(local)}"
                )
            if c.nbytes != volume(c.dst_box) * itemsize:
                raise PayloadError(
                    f"{name!r}: a chunk of {c.nbytes} bytes for region {_box_str(c.dst_box)}"
                )
            for other in got[:i]:
                both = tuple(
                    (max(a, x), min(b, y))
                    for (a, b), (x, y) in zip(c.dst_box, other.dst_box, strict=True)
                )
                if all(a < b for a, b in both):
                    raise PayloadError(
                        f"{name!r}: region {_box_str(both)} of receiving rank {r} is covered twice"
                    )
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
    for meta, src, dst in tensors:
        if tuple(meta.shape) != src.shape:
            raise PayloadError(
                f"{meta.name!r}: metadata of shape {list(meta.shape)}, layout of shape "
                f"{list(src.shape)}"
            )
        per_tensor.append(plan_tensor(meta.name, meta.dtype.itemsize, src, dst))
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
