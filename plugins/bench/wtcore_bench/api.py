"""What an engine or a client declares so that ``wtcore bench`` (or any tool) can drive it.

An :class:`EngineBench` is ``engine.<name>`` and a :class:`ClientBench` ``client.<name>`` in the
entry-point group ``wtcore.bench``, never attributes of the protocol's classes, so loading an
engine never loads the bench. See docs/writing-an-engine.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from wtcore.errors import PayloadError, WtcoreError

if TYPE_CHECKING:
    import torch

    from wtcore.client import InspectableClient
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = [
    "Baseline",
    "BaselineContext",
    "BaselineSession",
    "BenchNotSupportedError",
    "ClientBench",
    "EngineBench",
    "ModelSpec",
    "OptionalDependencyError",
    "ReceiverFleet",
    "ReceiverLauncher",
    "device_kind",
]


class BenchNotSupportedError(WtcoreError, NotImplementedError):
    """An engine or client lacks the part of the bench API that was needed."""


class OptionalDependencyError(WtcoreError, ImportError):
    """A feature needs a package that is not installed; the message says how to install it."""


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic model, rebuilt identically (names, shapes, dtypes) on every receiver."""

    size_bytes: int
    num_tensors: int
    dtype: str
    seed: int = 0
    #: Where receivers hold the model (``"cpu"`` or ``"cuda[:N]"``, ``wtcore bench --device``).
    device: str = "cpu"

    def build_state(self) -> dict[str, torch.Tensor]:
        from wtcore_kit.synthetic import synthetic_state

        return synthetic_state(self.size_bytes, self.num_tensors, self.dtype, self.seed)

    def build_zeros(self) -> torch.nn.Module:
        from wtcore_kit.synthetic import build_module, zeros_like_state

        return build_module(zeros_like_state(self.build_state())).to(self.device)


@dataclass(frozen=True)
class BaselineContext:
    state: Mapping[str, torch.Tensor]
    nbytes: int
    receivers: int
    host: str = "127.0.0.1"
    timeout_s: float = 300.0
    #: Where the model lives (``state`` is on the CPU; a baseline moves it here first).
    device: str = "cpu"


def device_kind(device: str) -> str:
    return device.split(":", 1)[0]


#: A baseline's round-by-round form: ``session(ctx)`` is a context manager yielding a callable
#: that moves ``ctx.nbytes`` once per call (see :class:`Baseline`).
BaselineSession = Callable[[BaselineContext], AbstractContextManager[Callable[[], object]]]


@dataclass(frozen=True)
class Baseline:
    """One limit, naive baseline or peer (what a user would run instead of wtcore).

    ``measure`` returns GB/s, releases what it started and checks what arrived; a missing
    package is an :class:`OptionalDependencyError` and the run goes on. Only a baseline with a
    ``session`` can be measured in turns with the engine's rounds (``--interleave``).
    """

    label: str
    measure: Callable[[BaselineContext], float]
    peer: bool = False
    devices: tuple[str, ...] = ("cpu",)
    session: BaselineSession | None = None


class ReceiverFleet(Protocol):
    """A started set of receivers: a fan-out ``client`` and the PIDs behind it; ``close`` stops
    every receiver, always, once."""

    client: InspectableClient

    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


class ReceiverLauncher(Protocol):
    """Starts ``count`` receivers, each hosting ``model.build_zeros()`` behind worker engine
    ``backend``, and a ``client_cls`` reaching them all; ``options`` are extra
    ``WeightSyncWorker`` arguments (one it cannot honour is a ``WtcoreError``)."""

    def __call__(
        self,
        client_cls: type[Any],
        backend: str,
        count: int,
        model: ModelSpec,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> ReceiverFleet: ...


@dataclass(frozen=True)
class EngineBench:
    """How a trainer engine runs in ``wtcore bench``; engines with an address to meet at
    override :meth:`init_info` and choose free ports themselves."""

    #: The init-info field ``--buffer-size`` sets (``None``: the engine has none).
    buffer_option: str | None = None
    baselines: Mapping[str, Baseline] = field(default_factory=dict)
    #: Device kinds the engine's bench runs on (``--device``).
    devices: tuple[str, ...] = ("cpu",)
    #: ``--engine-option`` names that prepare the trainer's model instead of setting a field:
    #: ``fn(model, value)`` is a context manager held around the rounds.
    model_options: Mapping[str, Callable[[Any, Any], AbstractContextManager[object]]] = field(
        default_factory=dict
    )

    def check_device(self, engine: type[TrainerWeightTransferEngine], device: str) -> None:
        if device_kind(device) not in self.devices:
            raise BenchNotSupportedError(
                f"trainer engine {engine.__name__} cannot run the bench on --device {device}: "
                f"it supports {', '.join(self.devices)}"
            )

    def init_info(
        self,
        engine: type[TrainerWeightTransferEngine],
        *,
        receivers: int,
        host: str,
        buffer_size_bytes: int | None,
        device: str = "cpu",
    ) -> TrainerInitInfo:
        """The sender's init info; ``device`` is passed only when not ``"cpu"``, so older
        subclasses keep working on the CPU."""
        kwargs: dict[str, Any] = dict(self.buffer_kwargs(engine, buffer_size_bytes))
        if device != "cpu":
            kwargs["device"] = device
        try:
            return engine.init_info_cls(rank=0, **kwargs)
        except TypeError as e:  # a field this default does not know how to fill
            raise PayloadError(
                f"{engine.init_info_cls.__name__}: cannot build the bench's init info from "
                f"{sorted(kwargs)} ({e}); give {engine.__name__} an EngineBench subclass "
                "that overrides init_info"
            ) from e

    def buffer_kwargs(
        self, engine: type[TrainerWeightTransferEngine], buffer_size_bytes: int | None
    ) -> dict[str, int]:
        if buffer_size_bytes is None:
            return {}
        if self.buffer_option is None:
            raise BenchNotSupportedError(
                f"trainer engine {engine.__name__} has no buffer size option: "
                "run the bench without --buffer-size"
            )
        return {self.buffer_option: buffer_size_bytes}


@dataclass(frozen=True)
class ClientBench:
    """How the bench starts receivers for one client: a :class:`ReceiverLauncher` (one whose
    class sets ``places_on_nodes = True`` can use ``--nodes``) and its transport's peers."""

    launcher: Callable[..., Any]
    baselines: Mapping[str, Baseline] = field(default_factory=dict)
