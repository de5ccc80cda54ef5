"""Transactional updates: stage a round's tensors, swap them in only at finish.

Without staging, a round that fails half-way leaves the model mixed (some tensors new, some
old), and the receiver can only *report* that. With ``WeightSyncWorker(transactional=True)``
incoming tensors are copied into staging buffers instead, and applied to the real sink in one
pass at ``finish_weight_update``; a failed round throws the staged data away and the old
weights keep serving, untouched.

Cost: one extra copy of every tensor the round touches, kept between rounds so later rounds
do not allocate (fresh memory is much slower to write than reused memory; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.sink import ReadableSink, check_batch

if TYPE_CHECKING:
    import torch

__all__ = ["StagingSink"]


class StagingSink:
    """Wraps a readable sink; ``load_weights`` stages, :meth:`commit` applies."""

    def __init__(self, inner: ReadableSink) -> None:
        if not isinstance(inner, ReadableSink):
            raise PayloadError(
                f"transactional updates need a sink with named_tensors(); "
                f"{type(inner).__name__} has none"
            )
        self.inner = inner
        self._targets = dict(inner.named_tensors())
        self._buffers: dict[str, torch.Tensor] = {}
        # Insertion-ordered, so commit applies in arrival order; membership is O(1).
        self._round: dict[str, None] = {}

    def begin(self) -> None:
        """Start a round with nothing staged."""
        self._round = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        batch = list(weights)
        check_batch(self._targets, batch, who="transactional sink")
        with torch.no_grad():
            for name, t in batch:
                buf = self._buffers.get(name)
                if buf is None:
                    target = self._targets[name]
                    buf = self._buffers[name] = torch.empty_like(target)
                buf.copy_(t)
                self._round[name] = None

    def commit(self) -> None:
        """Apply everything staged this round to the real sink."""
        staged, self._round = list(self._round), {}
        if staged:
            self.inner.load_weights([(n, self._buffers[n]) for n in staged])

    def rollback(self) -> None:
        """Forget this round's staged data; the real sink was never touched."""
        self._round = {}

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the sink will hold after a commit: staged tensors over the current ones."""
        staged = self._round
        for name, t in self.inner.named_tensors():
            yield name, self._buffers[name] if name in staged else t
