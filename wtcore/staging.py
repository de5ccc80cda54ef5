"""Transactional updates (``transactional=True``): stage a round, apply it only at finish, so a
failed round leaves the old weights serving. Buffers are kept between rounds (fresh memory
is much slower to write than reused memory)."""

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
        # a dict: commit applies in arrival order, membership is O(1)
        self._round: dict[str, None] = {}

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
        staged, self._round = list(self._round), {}
        if staged:
            self.inner.load_weights([(n, self._buffers[n]) for n in staged])

    def rollback(self) -> None:
        """Forget this round's staged data; the real sink was never touched."""
        self._round = {}

    begin = rollback  # a round starts with nothing staged

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the sink will hold after a commit: staged tensors over the current ones."""
        staged = self._round
        for name, t in self.inner.named_tensors():
            yield name, self._buffers[name] if name in staged else t
