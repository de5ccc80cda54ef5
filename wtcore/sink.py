"""Worker-side sinks: where received weights are loaded.

A sink is the inverse of a source. :class:`ModuleSink` validates a whole batch (names, shapes,
dtypes) before it copies anything, so that a bad batch leaves the model exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from wtcore.errors import PayloadError
from wtcore.meta import dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["ModuleSink", "ReadableSink", "WeightSink", "check_batch"]


@runtime_checkable
class WeightSink(Protocol):
    """Anything that can load ``(name, tensor)`` pairs, such as a vLLM model's ``load_weights``.

    The tensors handed to a sink may be views into a reused receive buffer: a sink must copy
    what it keeps before returning.
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@runtime_checkable
class ReadableSink(WeightSink, Protocol):
    """A sink that can also show what it holds (used for checksums and verification)."""

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class ModuleSink:
    """Copies incoming tensors into a module's parameters (and buffers) by name."""

    def __init__(self, module: torch.nn.Module, *, include_buffers: bool = True) -> None:
        self.module = module
        self.include_buffers = include_buffers
        self._targets: dict[str, torch.Tensor] = dict(self.named_tensors())

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()
        if self.include_buffers:
            yield from self.module.named_buffers()

    def patch_targets(self) -> Mapping[str, torch.Tensor]:
        """The live tensors by name: delta rounds patch these in place (wtcore.delta)."""
        return self._targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        batch = list(weights)
        check_batch(self._targets, batch, who="ModuleSink")
        with torch.no_grad():
            for name, t in batch:
                self._targets[name].copy_(t)


def check_batch(
    targets: Mapping[str, torch.Tensor],
    batch: Sequence[tuple[str, torch.Tensor]],
    *,
    who: str,
) -> None:
    """Raise one :class:`PayloadError` listing every name, shape or dtype that doesn't fit."""
    problems: list[str] = []
    for name, t in batch:
        target = targets.get(name)
        if target is None:
            problems.append(f"{name!r}: unknown parameter name")
        elif tuple(target.shape) != tuple(t.shape):
            problems.append(
                f"{name!r}: shape mismatch, expected {list(target.shape)}, got {list(t.shape)}"
            )
        elif target.dtype != t.dtype:
            problems.append(
                f"{name!r}: dtype mismatch, expected {dtype_name(target.dtype)}, "
                f"got {dtype_name(t.dtype)}"
            )
    if problems:
        raise PayloadError(
            f"{who} rejected {len(problems)} of {len(batch)} tensors; nothing of this "
            "batch was loaded:\n  - " + "\n  - ".join(problems)
        )
