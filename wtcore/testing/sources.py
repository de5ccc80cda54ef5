"""Synthetic models and sources for tests (the builders live in :mod:`wtcore.synthetic`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta, metas_from_wire, metas_to_wire
from wtcore.source import WeightSource
from wtcore.synthetic import build_module, synthetic_state, zeros_like_state

if TYPE_CHECKING:
    import torch

__all__ = [
    "MISMATCH_KINDS",
    "KillingSource",
    "MismatchedSource",
    "build_module",
    "mixed_dtype_state",
    "spec_of",
    "state_of_spec",
    "synthetic_state",
    "zeros_like_state",
]

#: The ways :class:`MismatchedSource` can disagree with its metadata.
MISMATCH_KINDS: tuple[str, ...] = ("reordered", "redtyped", "reshaped", "missing", "extra")


def mixed_dtype_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors of every common dtype, including 0-d and empty ones."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "f32.weight": torch.randn(4, 5, generator=g),
        "bf16.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "f16.weight": torch.randn(16, generator=g).to(torch.float16),
        "i64.index": torch.randint(-(2**40), 2**40, (5,), generator=g, dtype=torch.int64),
        "bool.mask": torch.rand(6, generator=g) > 0.5,
        "scalar.zero_d": torch.randn((), generator=g),
        "empty.weight": torch.empty(0, 3),
        "big.weight": torch.randn(64, 64, generator=g),
    }


class MismatchedSource(WeightSource):
    """Wraps a source so that iteration disagrees with metadata in one way (``kind``)."""

    def __init__(self, inner: WeightSource, kind: str) -> None:
        if kind not in MISMATCH_KINDS:
            raise PayloadError(f"kind must be one of {MISMATCH_KINDS}, got {kind!r}")
        self.inner = inner
        self.kind = kind

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        items = list(self.inner)
        if len(items) < 2:
            raise PayloadError("MismatchedSource needs at least two tensors")
        last = len(items) - 1
        if self.kind == "reordered":
            items[last - 1], items[last] = items[last], items[last - 1]
        elif self.kind == "redtyped":
            name, t = items[last]
            other = torch.float64 if t.dtype != torch.float64 else torch.float32
            items[last] = (name, t.to(other))
        elif self.kind == "reshaped":
            name, t = items[last]
            items[last] = (name, t.reshape(-1, 1) if t.dim() != 2 else t.reshape(-1))
        elif self.kind == "missing":
            items.pop()
        elif self.kind == "extra":
            items.append(("extra.weight", torch.zeros(3)))
        return iter(items)


class KillingSource(WeightSource):
    """Yields ``inner``'s tensors and calls ``kill()`` just before item ``at``: a receiver that
    dies in the middle of a round (a process SIGKILLed, a server stopped, an actor killed).

    ``kill`` is whatever ends the peer for the transport under test, so one source serves every
    engine's and client's failure tests.
    """

    def __init__(self, inner: WeightSource, kill: Callable[[], object], at: int) -> None:
        self.inner, self.kill, self.at = inner, kill, at

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.at:
                self.kill()
            yield item


def spec_of(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The names, dtypes and shapes of ``state`` as the JSON-safe wire triple
    (:func:`wtcore.meta.metas_to_wire`): what a worker process needs to build a zero model."""
    return metas_to_wire([ParamMeta.of(n, t) for n, t in state.items()])


def state_of_spec(spec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Zeros shaped like :func:`spec_of`'s ``spec`` (checked as the wire checks it)."""
    import torch

    metas = metas_from_wire(spec["names"], spec["dtype_names"], spec["shapes"])
    return {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas}
