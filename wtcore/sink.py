"""Worker-side sinks: where received weights are loaded.

A sink is the inverse of a source. :class:`ModuleSink` validates a whole batch (names, shapes,
dtypes) before it copies anything, so that a bad batch leaves the model exactly as it was.

A sink may also offer a tensor's *destination* (:class:`DirectSink`): an engine then receives
that tensor's bytes straight into it instead of into a buffer it would copy out of. Sinks
that wrap another (staging, the non-finite check) do not offer one, so they still see every
tensor before it is applied.
"""

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
    """Anything that can load ``(name, tensor)`` pairs, such as a vLLM model's ``load_weights``.

    The tensors handed to a sink may be views into a reused receive buffer: a sink must copy
    what it keeps before returning.
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@runtime_checkable
class ReadableSink(WeightSink, Protocol):
    """A sink that can also show what it holds (used for checksums and verification)."""

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class DirectSink(WeightSink, Protocol):
    """A sink that can offer the tensor an incoming weight may be written into in place.

    ``destination`` returns that tensor (same dtype and shape, contiguous) or ``None`` (the
    engine then hands the tensor to ``load_weights`` as usual). An engine writes the bytes
    into the offered tensor while the round runs and does not call ``load_weights`` for it,
    so a sink offers only tensors it would have overwritten in place anyway.
    """

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


_DIRECT_MEMBERS = ("load_weights", "destination")


def _offers_destinations(sink: WeightSink) -> TypeGuard[DirectSink]:
    """``isinstance(sink, DirectSink)``, without the protocol check's cost on every tensor
    (a runtime protocol re-collects its members on each check: tens of microseconds, a fifth
    of an ipc round of 300 tensors at memory speed). The same test: every member present."""
    return all(getattr(sink, m, None) is not None for m in _DIRECT_MEMBERS)


def direct_destination(
    sink: WeightSink, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: str
) -> torch.Tensor | None:
    """The tensor ``sink`` offers for ``name``, if an engine on ``device`` may write into it.

    The offer is checked, not trusted: a tensor of another dtype, shape, layout or device is
    refused (``None``), so the engine's receive can never write more or fewer bytes than the
    tensor holds.
    """
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
    """Copies incoming tensors into a module's parameters (and buffers) by name.

    ``layout`` says that the module holds this receiver's TP slices
    (:class:`~wtcore.sharded.receiver_layout.TPLayout`): its parameters have their local shapes, and
    the receiver reports the layout in ``weight_info()`` so that a trainer can plan to send it
    only its slices. Without one the module holds whole tensors.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        include_buffers: bool = True,
        layout: TPLayout | None = None,
    ) -> None:
        from wtcore.sharded.receiver_layout import TPLayout

        if layout is not None and not isinstance(layout, TPLayout):
            raise PayloadError(f"layout: expected a TPLayout or None, got {type(layout).__name__}")
        self.module = module
        self.include_buffers = include_buffers
        self.layout = layout
        self._targets: dict[str, torch.Tensor] = dict(self.named_tensors())

    def receiver_layout(self) -> TPLayout | None:
        """How this receiver is sharded (``None``: whole replicas); see :class:`LaidOutSink`."""
        return self.layout

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()
        if self.include_buffers:
            yield from self.module.named_buffers()

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The parameter (or buffer) ``name`` itself when its dtype, shape and layout match.

        A subclass that overrides ``load_weights`` (and not this method) is offered nothing,
        so its ``load_weights`` still sees every tensor.
        """
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
