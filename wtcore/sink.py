"""Worker-side sinks: where received weights are loaded. Sinks that wrap another (staging, the
finite check) offer no destination, so they still see every tensor before it is applied."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from wtcore.errors import PayloadError
from wtcore.meta import dtype_name

if TYPE_CHECKING:
    import torch

    from wtcore.sharded.receiver_layout import TPLayout

__all__ = [
    "DirectSink",
    "LaidOutSink",
    "ModuleSink",
    "ReadableSink",
    "WeightSink",
    "check_batch",
    "direct_destination",
    "on_device",
]


@runtime_checkable
class WeightSink(Protocol):
    """Anything that can load ``(name, tensor)`` pairs, such as a vLLM model's ``load_weights``;
    they may be views into a reused buffer, so copy what you keep before returning."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@runtime_checkable
class ReadableSink(WeightSink, Protocol):
    """A sink that can also show what it holds (used for checksums and verification)."""

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class DirectSink(WeightSink, Protocol):
    """A sink that can offer the tensor (same dtype and shape, contiguous; or ``None``) an
    incoming weight is written into mid-round, bypassing ``load_weights``: offer only tensors
    you would overwrite in place anyway."""

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None: ...


@runtime_checkable
class LaidOutSink(WeightSink, Protocol):
    """A sink that knows how its receiver is sharded; the worker reports it in
    ``weight_info()["layout"]`` (``None``: whole replicas)."""

    def receiver_layout(self) -> TPLayout | None: ...


def on_device(t: torch.Tensor, device: str) -> bool:
    """Whether ``t`` lives on ``device`` (``"cuda"`` means the current CUDA device)."""
    if device == "cpu":  # the common case, without building a torch.device per tensor
        return t.device.type == "cpu"
    import torch

    want = torch.device(device)
    if t.device.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return t.device.index == torch.cuda.current_device()
    return want.index is None or t.device.index == want.index


def _offers_destinations(sink: WeightSink) -> TypeGuard[DirectSink]:
    """``isinstance(sink, DirectSink)`` without a runtime protocol check's cost (tens of
    microseconds) on every tensor."""
    return all(getattr(sink, m, None) is not None for m in ("load_weights", "destination"))


def direct_destination(
    sink: WeightSink, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: str
) -> torch.Tensor | None:
    """The tensor ``sink`` offers for ``name``, if an engine on ``device`` may write into it:
    checked, not trusted, so a receive never writes more or fewer bytes than it holds."""
    import torch

    if not _offers_destinations(sink):
        return None
    t = sink.destination(name, dtype, shape)
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or tuple(t.shape) != tuple(shape)
        or not t.is_contiguous()
        or not on_device(t, device)
    ):
        return None
    return t.detach()


class ModuleSink:
    """Copies incoming tensors into a module's parameters (and buffers) by name, checking the
    whole batch first. ``layout``: the module holds this receiver's TP slices only (or its
    experts only: :meth:`place` changes them between rounds)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        include_buffers: bool = True,
        layout: TPLayout | None = None,
    ) -> None:
        self.include_buffers = include_buffers
        self.place(module, layout)

    def place(self, module: torch.nn.Module, layout: TPLayout | None = None) -> None:
        """Hold ``module``, laid out by ``layout``, from the next round on (between rounds:
        a new expert placement); the worker reports it and plans the next round to it."""
        from wtcore.sharded.receiver_layout import TPLayout

        if layout is not None and not isinstance(layout, TPLayout):
            raise PayloadError(f"layout: expected a TPLayout or None, got {type(layout).__name__}")
        self.module, self.layout = module, layout
        self._targets: dict[str, torch.Tensor] = dict(self.named_tensors())

    def receiver_layout(self) -> TPLayout | None:
        """How this receiver is sharded (``None``: whole replicas)."""
        return self.layout

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()
        if self.include_buffers:
            yield from self.module.named_buffers()

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The parameter (or buffer) ``name`` itself when dtype, shape and layout match; nothing
        for a subclass that overrides only ``load_weights``, so it still sees every tensor."""
        cls = type(self)
        if (
            cls.load_weights is not ModuleSink.load_weights
            and cls.destination is ModuleSink.destination
        ):
            return None
        t = self._targets.get(name)
        if t is None or t.dtype != dtype or tuple(t.shape) != tuple(shape):
            return None
        return t.detach() if t.is_contiguous() else None

    def patch_targets(self) -> Mapping[str, torch.Tensor]:
        """The live tensors by name: delta rounds patch these in place (wtcore_delta)."""
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
