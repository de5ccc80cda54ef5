"""What an engine or a client declares so that ``wtcore bench`` (or any tool) can drive it.

The bench never picks a plugin by name and never guesses field names. Everything it needs
comes from two class-level APIs:

* a **trainer engine class** (:class:`~wtcore.trainer.TrainerWeightTransferEngine`) says how to
  build its init info for ``N`` receivers on this host (``bench_init_info``), which init-info
  field sets its bucket size (``buffer_option``), and which limits and naive baselines are
  worth measuring next to it (``bench_baselines``, a mapping of name to :class:`Baseline`);
* a **client class** (registered in ``wtcore.clients``) says how to start receivers it can reach
  (:class:`ReceiverLauncher`: a ``launch_receivers`` classmethod returning a
  :class:`ReceiverFleet`).

Each receiver hosts :meth:`ModelSpec.build_zeros`, the same names, shapes and dtypes as the
trainer's model, so only the four numbers of a :class:`ModelSpec` travel. See
``docs/writing-an-engine.md`` for a worked example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from wtcore.errors import WtcoreError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Baseline",
    "BaselineContext",
    "BenchNotSupportedError",
    "ModelSpec",
    "OptionalDependencyError",
    "ReceiverFleet",
    "ReceiverLauncher",
]


class BenchNotSupportedError(WtcoreError, NotImplementedError):
    """An engine or client does not implement the part of the bench API that was needed."""


class OptionalDependencyError(WtcoreError, ImportError):
    """A feature needs a package that is not installed; the message gives the install line."""


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic model, rebuilt identically (names, shapes, dtypes) on every receiver."""

    size_bytes: int
    num_tensors: int
    dtype: str
    seed: int = 0

    def build_state(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        from wtcore.synthetic import synthetic_state

        return synthetic_state(
            self.size_bytes, self.num_tensors, self.dtype, self.seed if seed is None else seed
        )

    def build_zeros(self) -> torch.nn.Module:
        """A receiver model: the right names, shapes and dtypes, all zeros."""
        from wtcore.synthetic import build_module, zeros_like_state

        return build_module(zeros_like_state(self.build_state()))


@dataclass(frozen=True)
class BaselineContext:
    """What a baseline gets: the trainer's model and the run's settings."""

    state: Mapping[str, torch.Tensor]
    nbytes: int
    receivers: int
    host: str = "127.0.0.1"
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Baseline:
    """One limit or naive baseline: a label for tables and plots, and how to measure it.

    ``measure`` returns GB/s (1e9 bytes per second of wall time), typically the median of a
    few repeats; it must release everything it started (processes, segments) before returning.
    """

    label: str
    measure: Callable[[BaselineContext], float]


class ReceiverFleet(Protocol):
    """A started set of receivers: a fan-out ``client`` and the PIDs behind it.

    ``client`` offers the four vLLM calls plus ``weight_info()`` and ``checksums()``; ``close``
    stops every receiver (always, even after a failure) and may be called once.
    """

    client: Any

    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


@runtime_checkable
class ReceiverLauncher(Protocol):
    """A client class that can start receivers for the bench.

    ``launch_receivers`` starts ``count`` receivers, rank ``i`` of ``count``, each hosting
    ``model.build_zeros()`` behind worker engine ``backend``; ``options`` are extra
    ``WeightSyncWorker`` keyword arguments (e.g. ``transactional``). It raises a
    :class:`~wtcore.errors.WtcoreError` for options it cannot honour.
    """

    @classmethod
    def launch_receivers(
        cls,
        backend: str,
        count: int,
        model: ModelSpec,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> ReceiverFleet: ...
