"""Per-tensor byte accounting: a round is published only if every announced byte landed.

An engine that answers 200 while moving nothing (a skipped tensor, a short receive that it
does not notice) would otherwise publish old bytes under a new version. :class:`ByteLedger`
is the outermost sink of a worker's chain, so it sees exactly what the engine delivers: the
bytes of every tensor handed to ``load_weights``, and of every tensor the engine took to write
in place (``destination``; an engine whose in-place receive fails raises, and the round fails
with it). Each ``update_weights`` adds what it announced (the engine's parsed ``metas``); at
finish, any announced tensor with fewer bytes than planned fails the round, naming it.
Engines whose update info announces no ``metas`` are not accounted (there is no plan).
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
        """Add one update's announcement (ignored unless it is a list of ``ParamMeta``), and
        pass it on, as it is, to the receiver layers that take it (before any tensor lands)."""
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
        short = [(n, self.landed.get(n, 0), p) for n, p in self.planned.items()]
        short = [(n, got, want) for n, got, want in short if got < want]
        if short:
            shown = ", ".join(f"{n!r} ({got} of {want} bytes)" for n, got, want in short[:5])
            more = ", ..." if len(short) > 5 else ""
            raise PayloadError(
                f"round incomplete: {len(short)} announced tensor(s) received fewer bytes than "
                f"planned: {shown}{more}; the round is not published"
            )
