"""``wtcore bench``: the main job end to end, verified bit for bit, measured against baselines.

Engines and clients declare their bench support in entry-point groups
(:mod:`wtcore_bench.api`, :mod:`wtcore_bench.support`); any mismatch in any round fails the run.
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
