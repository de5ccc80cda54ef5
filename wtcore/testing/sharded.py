"""The sharded plan's reference semantics, for tests: every plan-executing engine is checked
against this, so it is as plain as possible (one region copy per chunk, no buckets, no wire)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from wtcore.meta import ParamMeta
from wtcore.sharded.layout import region
from wtcore.sharded.source import ShardedSource

if TYPE_CHECKING:
    import torch

    from wtcore.sharded.layout import Box, Layout
    from wtcore.sharded.plan import Plan

__all__ = ["PartsSource", "execute_plan", "part"]


def part(full: torch.Tensor, box: Box | None) -> torch.Tensor | None:
    """The region ``box`` of ``full`` (a view), or ``None`` for a rank that holds nothing."""
    return None if box is None else region(full, box)


def execute_plan(
    full: Mapping[str, torch.Tensor],
    plan: Plan,
    src: Mapping[str, Layout],
    dst: Mapping[str, Layout],
) -> tuple[dict[tuple[str, int], torch.Tensor], dict[int, int]]:
    """Run ``plan`` from the senders' parts of ``full`` into fresh receiver parts (filled with
    -1 first, so an element no chunk wrote shows); returns them by ``(name, rank)`` and the
    bytes each receiving rank got."""
    import torch

    held = {
        (n, r): region(t, b_).clone()
        for n, t in full.items()
        for r, b_ in enumerate(src[n].boxes)
        if b_ is not None
    }
    out = {
        (n, r): torch.full(dst[n].local_shape(r), -1, dtype=t.dtype)
        for n, t in full.items()
        for r, b_ in enumerate(dst[n].boxes)
        if b_ is not None
    }
    got: dict[int, int] = {}
    for c in plan.select():
        moved = region(held[(c.name, c.src)], c.src_box)
        region(out[(c.name, c.dst)], c.dst_box).copy_(moved)
        got[c.dst] = got.get(c.dst, 0) + moved.numel() * moved.element_size()
    return out, got


class PartsSource(ShardedSource):
    """Trainer rank ``rank``'s parts of whole tensors under any layouts (2-D meshes, odd
    splits: layouts no parallelism library makes on two cores)."""

    def __init__(
        self, full: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout], rank: int
    ) -> None:
        self.full, self._layouts, self.rank = dict(full), dict(layouts), rank

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta.of(n, t) for n, t in self.full.items()]

    def layouts(self) -> dict[str, Layout]:
        return dict(self._layouts)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.full.items():
            p = part(t, self._layouts[name].boxes[self.rank])
            if p is not None:
                yield name, p.clone()
