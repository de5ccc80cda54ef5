"""Reject non-finite weights before they reach the model.

A diverged training step produces NaN or Inf weights; serving them silently corrupts every
rollout that follows. ``WeightSyncWorker(reject_nonfinite=True)`` checks every floating-point
tensor of a batch before any of it is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.sink import ReadableSink, WeightSink

if TYPE_CHECKING:
    import torch

__all__ = ["FiniteCheckSink"]


class FiniteCheckSink:
    """Wraps a sink; a batch with any NaN or Inf is refused whole, naming the tensors."""

    def __init__(self, inner: WeightSink) -> None:
        self.inner = inner

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        batch = list(weights)
        bad = [
            name
            for name, t in batch
            if (t.is_floating_point() or t.is_complex())
            and t.numel()
            and not bool(torch.isfinite(t).all())
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
            raise TypeError(f"{type(self.inner).__name__} has no named_tensors()")
        yield from self.inner.named_tensors()
