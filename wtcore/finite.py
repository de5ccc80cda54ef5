"""``reject_nonfinite=True``: refuse a batch with NaN or Inf (a diverged step) before any loads.

Torch has no ``isfinite`` for most float8 formats, so those are widened to float32 a chunk at
a time (NaN and Inf survive the widening; a chunk bounds the extra memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.sink import ReadableSink, WeightSink

if TYPE_CHECKING:
    import torch

__all__ = ["FiniteCheckSink", "is_all_finite"]

#: Elements widened to float32 at once for dtypes torch cannot check directly (4 MiB).
_CHUNK = 1 << 20


def is_all_finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating or complex tensor is finite (any dtype, float8 too)."""
    import torch

    try:
        return bool(torch.isfinite(t).all())
    except (NotImplementedError, RuntimeError):
        flat = t.reshape(-1)
        return all(
            bool(torch.isfinite(flat[i : i + _CHUNK].float()).all())
            for i in range(0, flat.numel(), _CHUNK)
        )


class FiniteCheckSink:
    """Wraps a sink; a batch with any NaN or Inf is refused whole, naming the tensors."""

    def __init__(self, inner: WeightSink) -> None:
        self.inner = inner

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        bad = [
            name
            for name, t in batch
            if (t.is_floating_point() or t.is_complex()) and t.numel() and not is_all_finite(t)
        ]
        if bad:
            raise PayloadError(
                f"rejected non-finite weights (NaN or Inf) in {len(bad)} tensor(s): "
                f"{', '.join(map(repr, bad[:10]))}{', ...' if len(bad) > 10 else ''}; "
                "nothing of this batch was loaded"
            )
        self.inner.load_weights(batch)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not isinstance(self.inner, ReadableSink):
            raise PayloadError(f"{type(self.inner).__name__} has no named_tensors()")
        yield from self.inner.named_tensors()
