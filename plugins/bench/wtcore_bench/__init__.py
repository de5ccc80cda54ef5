"""``wtcore bench``: the main job end to end, verified bit for bit, measured against baselines.

Receivers are started by the bench itself, through the chosen client's :class:`ClientBench`;
the trainer engine's :class:`EngineBench` says how to set it up on this host and which baselines
matter. Both are declared in entry-point groups keyed by the plugin's registered name
(:mod:`wtcore_bench.support`), never on the protocol's classes. Every round is verified with
digests computed on both sides; any mismatch makes the run fail. See :mod:`wtcore_bench.api`.
"""

from __future__ import annotations

from wtcore_bench.api import (
    Baseline,
    BaselineContext,
    BenchNotSupportedError,
    ClientBench,
    EngineBench,
    ModelSpec,
    OptionalDependencyError,
    ReceiverFleet,
    ReceiverLauncher,
)
from wtcore_bench.runner import BenchOptions, run_bench

__all__ = [
    "Baseline",
    "BaselineContext",
    "BenchNotSupportedError",
    "BenchOptions",
    "ClientBench",
    "EngineBench",
    "ModelSpec",
    "OptionalDependencyError",
    "ReceiverFleet",
    "ReceiverLauncher",
    "run_bench",
]
