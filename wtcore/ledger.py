"""Per-tensor byte accounting: a round is published only if every announced byte landed.

:class:`ByteLedger` is the outermost sink of a worker's chain, so it sees exactly what the
engine delivers (handed over, or taken to write in place).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta

if TYPE_CHECKING:
    import torch

    from wtcore.sink import WeightSink

__all__ = ["ByteLedger"]


class ByteLedger:
    """Counts planned and landed bytes per tensor name for the open round."""

    def __init__(self, inner: WeightSink, layers: Sequence[object] = ()) -> None:
        self.inner = inner
        #: The worker's receiver layers that take each announcement (``plan``), in order.
        self.planners: list[Any] = [x for x in layers if callable(getattr(x, "plan", None))]
        self.planned: dict[str, int] = {}
        self.landed: dict[str, int] = {}

    def begin(self) -> None:
        self.planned, self.landed = {}, {}

    def plan(self, metas: object) -> None:
        """Add one update's announcement (if a list of ``ParamMeta``); pass it on to the
        layers that take it, before any tensor lands."""
        if isinstance(metas, Sequence) and all(isinstance(m, ParamMeta) for m in metas):
            for m in metas:
                self.planned[m.name] = self.planned.get(m.name, 0) + m.nbytes
        for layer in self.planners:
            layer.plan(metas)

    def _land(self, name: str, t: torch.Tensor) -> None:
        self.landed[name] = self.landed.get(name, 0) + t.numel() * t.element_size()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        self.inner.load_weights(batch)
        for name, t in batch:
            self._land(name, t)

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        offer: Any = getattr(self.inner, "destination", None)
        t: torch.Tensor | None = offer(name, dtype, shape) if callable(offer) else None
        if t is not None:
            self._land(name, t)
        return t

    def totals(self) -> dict[str, int]:
        """``{"planned": bytes, "landed": bytes}`` of the open (or last) round."""
        return {"planned": sum(self.planned.values()), "landed": sum(self.landed.values())}

    def check(self) -> None:
        """Raise :class:`PayloadError` naming every announced tensor that got fewer bytes."""
        short = [(n, got, p) for n, p in self.planned.items() if (got := self.landed.get(n, 0)) < p]
        if short:
            shown = ", ".join(f"{n!r} ({got} of {want} bytes)" for n, got, want in short[:5])
            more = ", ..." if len(short) > 5 else ""
            raise PayloadError(
                f"round incomplete: {len(short)} announced tensor(s) received fewer bytes than "
                f"planned: {shown}{more}; the round is not published"
            )
