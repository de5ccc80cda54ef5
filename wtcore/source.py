"""Trainer-side sources of weights. ``metadata()`` and iteration must agree:
:func:`iter_checked` checks it before any byte of a mismatched tensor is sent."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta, dtype_name, materialize_full_tensor

if TYPE_CHECKING:
    import torch

    from wtcore.stats import TransferStats

__all__ = ["ModuleSource", "TensorSource", "WeightSource", "iter_checked"]


class WeightSource(ABC):
    """Where the trainer's weights come from; every trainer rank iterates it in lockstep
    (materializing a sharded tensor is a collective)."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every parameter that iteration will yield, in the same order, without moving data."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield fully materialized ``(name, tensor)`` pairs; a fresh pass each call."""

    def round_driver(
        self, engine: Any, verify: bool
    ) -> Callable[[WeightSource, TransferStats, str | None], None] | None:
        """How ``send_weights`` runs a round of this source on every rank (called with the
        round's source, stats and version); ``None``: rank 0 sends each tensor whole."""
        return None


class ModuleSource(WeightSource):
    """A source over ``module.named_parameters()``; a DTensor is gathered only when iterated."""

    def __init__(self, module: torch.nn.Module, *, include_buffers: bool = False) -> None:
        self.module = module
        self.include_buffers = include_buffers

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()
        if self.include_buffers:
            yield from self.module.named_buffers()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(int(d) for d in t.shape)) for n, t in self._named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named():
            yield name, materialize_full_tensor(t.detach())


class TensorSource(WeightSource):
    """A source over an in-memory mapping or list of ``(name, tensor)`` pairs."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        self._items: list[tuple[str, torch.Tensor]] = items

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta.of(n, t) for n, t in self._items]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self._items))


def _describe(meta: ParamMeta) -> str:
    return f"{meta.name!r} ({dtype_name(meta.dtype)}, shape {list(meta.shape)})"


def iter_checked(
    source: WeightSource, metas: Sequence[ParamMeta] | None = None
) -> Iterator[tuple[ParamMeta, torch.Tensor]]:
    """Iterate ``source``, checking each item (name, dtype, shape, count) against its metadata
    before yielding it, contiguous; a :class:`PayloadError` names the first mismatch."""
    expected = list(source.metadata()) if metas is None else list(metas)
    count = 0
    for name, tensor in source:
        if count >= len(expected):
            raise PayloadError(
                f"source yielded an extra tensor {name!r} at position {count}; "
                f"metadata lists only {len(expected)} tensors"
            )
        meta = expected[count]
        got = ParamMeta(name, tensor.dtype, tuple(int(d) for d in tensor.shape))
        if got != meta:
            raise PayloadError(
                f"source item {count} does not match its metadata: expected {_describe(meta)}, "
                f"got {_describe(got)}"
            )
        count += 1
        yield meta, tensor if tensor.is_contiguous() else tensor.contiguous()
    if count != len(expected):
        missing = ", ".join(repr(m.name) for m in expected[count : count + 5])
        raise PayloadError(
            f"source stopped after {count} tensors but metadata lists {len(expected)}; "
            f"missing: {missing}{', ...' if len(expected) - count > 5 else ''}"
        )
