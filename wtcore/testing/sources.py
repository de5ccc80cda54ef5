"""Synthetic models and sources for tests (the builders live in :mod:`wtcore.synthetic`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.source import WeightSource
from wtcore.synthetic import build_module, synthetic_state, zeros_like_state

if TYPE_CHECKING:
    import torch

__all__ = [
    "MISMATCH_KINDS",
    "MismatchedSource",
    "build_module",
    "mixed_dtype_state",
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
