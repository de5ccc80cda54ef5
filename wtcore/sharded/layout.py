"""How one tensor is laid out over the ranks of one side: its global shape, each rank's box.

Why a box per rank and not a placement: a box is what both ends can check and intersect
without knowing the other side's parallelism. FSDP2's ``Shard(0)``, TP's column and row splits,
a 2-D mesh of both, a replicated tensor, and a tensor held by one pipeline or expert rank only
are all a list of boxes, one per rank (or ``None`` where a rank holds nothing); a whole tensor
is the one-rank case. The constructors below turn the usual placements into boxes, with
torch's rule for uneven splits (chunks of ``ceil(n / k)``, the last ones smaller or empty), so
a DTensor's local shard and the box this module gives its rank are the same region.

Everything that arrives over the wire (:meth:`Layout.from_wire`) is checked before use: types,
dimensions, rank count, and every box inside the global shape. The caller names the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.meta import MAX_NUMEL

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_DIMS",
    "MAX_RANKS",
    "Box",
    "Layout",
    "Replicate",
    "Shard",
    "is_int",
    "region",
    "split",
    "tp_box",
    "tp_layout",
    "volume",
]

#: The most dimensions a laid-out tensor may have.
MAX_DIMS = 8
#: The most ranks one side may have.
MAX_RANKS = 1 << 16

#: A region of a tensor: one ``(start, stop)`` per dimension, ``stop`` exclusive.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Shard:
    """Split dimension ``dim`` over a mesh dimension (torch's ``Shard(dim)``)."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank of a mesh dimension holds the same region (torch's ``Replicate()``)."""


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``n`` split in ``parts``: torch's uneven rule."""
    chunk = -(-n // parts) if parts else 0
    return min(index * chunk, n), min((index + 1) * chunk, n)


def volume(box: Box) -> int:
    """Elements in ``box``."""
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


@dataclass(frozen=True)
class Layout:
    """``shape`` is the global shape; ``boxes[r]`` is what rank ``r`` holds (``None``: nothing)."""

    shape: tuple[int, ...]
    boxes: tuple[Box | None, ...]

    @property
    def world_size(self) -> int:
        return len(self.boxes)

    @classmethod
    def whole(cls, shape: Sequence[int], *, owner: int = 0, world_size: int = 1) -> Layout:
        """Rank ``owner`` holds the whole tensor, the others nothing (pipeline or expert
        ownership; with the defaults, today's single gathering rank)."""
        full = tuple((0, int(d)) for d in shape)
        return cls(
            tuple(int(d) for d in shape),
            tuple(full if r == owner else None for r in range(world_size)),
        )

    @classmethod
    def placed(
        cls,
        shape: Sequence[int],
        mesh: Sequence[int],
        placements: Sequence[Shard | Replicate],
    ) -> Layout:
        """The boxes of a DTensor-style placement over a mesh of shape ``mesh`` (1-D or more;
        ranks numbered row-major), one placement per mesh dimension.

        Two mesh dimensions sharding the same tensor dimension split it in turn (the first
        mesh dimension's chunk is split again by the second), as torch does.
        """
        shape = tuple(int(d) for d in shape)
        if len(mesh) != len(placements) or not mesh:
            raise PayloadError(
                f"placements: {len(placements)} for a mesh of {len(mesh)} dimensions"
            )
        for p in placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
                raise PayloadError(f"placements: Shard({p.dim}) of a {len(shape)}-D tensor")
        boxes: list[Box | None] = []
        size = 1
        for m in mesh:
            size *= m
        for rank in range(size):
            coords, rest = [], rank
            for m in reversed(mesh):
                coords.append(rest % m)
                rest //= m
            coords.reverse()
            box = [(0, d) for d in shape]
            for p, m, c in zip(placements, mesh, coords, strict=True):
                if isinstance(p, Shard):
                    start, stop = box[p.dim]
                    lo, hi = split(stop - start, m, c)
                    box[p.dim] = (start + lo, start + hi)
            boxes.append(tuple(box))
        return cls(shape, tuple(boxes))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of rank ``rank``'s part (all zeros where it holds nothing)."""
        box = self.boxes[rank]
        if box is None:
            return tuple(0 for _ in self.shape)
        return tuple(stop - start for start, stop in box)

    # ------------------------------------------------------------------ the wire
    def to_wire(self) -> dict[str, Any]:
        """JSON-safe: ``{"shape": [...], "boxes": [[[start, stop], ...] or null, ...]}``."""
        return {
            "shape": list(self.shape),
            "boxes": [None if b is None else [list(d) for d in b] for b in self.boxes],
        }

    @classmethod
    def from_wire(cls, data: object, *, field: str = "layout") -> Layout:
        """Decode and check a layout from a peer; errors name ``field`` and the bad index."""
        if not isinstance(data, dict):
            raise PayloadError(f"{field}: expected an object, got {type(data).__name__}")
        shape = data.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise PayloadError(f"{field}.shape: expected a list of at most {MAX_DIMS} sizes")
        numel = 1
        for i, d in enumerate(shape):
            if not is_int(d) or not 0 <= d <= MAX_NUMEL:
                raise PayloadError(f"{field}.shape[{i}]: expected a size, got {d!r:.40}")
            numel *= d
        if numel > MAX_NUMEL:
            raise PayloadError(f"{field}.shape: more than {MAX_NUMEL} elements")
        boxes = data.get("boxes")
        if not isinstance(boxes, list) or not 0 < len(boxes) <= MAX_RANKS:
            raise PayloadError(f"{field}.boxes: expected a list of 1 to {MAX_RANKS} boxes")
        out: list[Box | None] = []
        for r, box in enumerate(boxes):
            where = f"{field}.boxes[{r}]"
            if box is None:
                out.append(None)
                continue
            if not isinstance(box, list) or len(box) != len(shape):
                raise PayloadError(f"{where}: expected {len(shape)} [start, stop] pairs or null")
            dims = []
            for d, pair in enumerate(box):
                ok = isinstance(pair, list) and len(pair) == 2 and all(map(is_int, pair))
                if not ok or not 0 <= pair[0] <= pair[1] <= shape[d]:
                    raise PayloadError(
                        f"{where}[{d}]: expected [start, stop] within 0..{shape[d]}, got "
                        f"{pair!r:.40}"
                    )
                dims.append((pair[0], pair[1]))
            out.append(tuple(dims))
        return cls(tuple(shape), tuple(out))


def is_int(x: object) -> bool:
    """An ``int`` that is not a ``bool`` (JSON's ``true`` must never pass for a size)."""
    return isinstance(x, int) and not isinstance(x, bool)


def region(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``t`` that ``box`` covers (in ``t``'s own coordinates)."""
    return t[tuple(slice(a, b) for a, b in box)]


#: vLLM's usual tensor-parallel layouts, as the dimension their weight is split on (None: whole).
_TP_KINDS: dict[str, int | None] = {
    "column": 0,  # ColumnParallelLinear: output features split ([out, in])
    "row": 1,  # RowParallelLinear: input features split
    "vocab": 0,  # VocabParallelEmbedding: vocabulary rows split (padding not modelled)
    "replicated": None,
}


def _tp_dim(shape: Sequence[int], kind: str, tp_size: int) -> int | None:
    """The dimension ``kind`` splits (None: none); refuses a bad kind or ``tp_size``, and more
    ranks than elements on the split dimension."""
    if kind not in _TP_KINDS:
        raise PayloadError(f"kind: expected one of {sorted(_TP_KINDS)}, got {kind!r}")
    if not is_int(tp_size) or not 0 < tp_size <= MAX_RANKS:
        raise PayloadError(f"tp_size: expected 1 to {MAX_RANKS}, got {tp_size!r}")
    dim = _TP_KINDS[kind]
    if dim is None or dim >= len(shape):
        return None
    if 0 < shape[dim] < tp_size:
        raise PayloadError(
            f"tp_size: {tp_size} ranks split dimension {dim} of {shape[dim]} elements"
        )
    return dim


def tp_box(shape: Sequence[int], kind: str, tp_size: int, tp_rank: int) -> Box:
    """TP rank ``tp_rank``'s box of a tensor of ``shape`` in a group of ``tp_size`` ranks.

    ``kind``: ``column``, ``row``, ``vocab`` or ``replicated``. A 1-D tensor of a ``row``
    layer (its bias) is replicated, as vLLM adds it once after the reduction. ``vocab``
    splits rows by torch's rule; vLLM pads the vocabulary to a multiple of 64 per rank first,
    which this does not model yet. Only this rank's box is computed: what a peer declares
    costs nothing beyond it.
    """
    dim = _tp_dim(shape, kind, tp_size)
    return tuple(
        split(int(d), tp_size, tp_rank) if i == dim else (0, int(d)) for i, d in enumerate(shape)
    )


def tp_layout(shape: Sequence[int], kind: str, tp_size: int) -> Layout:
    """The layout of a tensor of ``shape`` over a whole TP group (:func:`tp_box` of each rank)."""
    _tp_dim(shape, kind, tp_size)
    boxes = tuple(tp_box(shape, kind, tp_size, r) for r in range(tp_size))
    return Layout(tuple(int(d) for d in shape), boxes)
