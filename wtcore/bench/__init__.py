"""``wtcore bench``: the main job end to end, verified bit for bit, measured against limits.

Receivers are started by the bench itself, through the chosen client class's
``bench_launcher``; the trainer engine class's ``bench`` (an :class:`EngineBench`) says how to
set it up on this host and which baselines matter. Every round is verified with digests
computed on both sides; any mismatch makes the run fail. See :mod:`wtcore.bench.api`.
"""

from __future__ import annotations

from wtcore.bench.api import (
    Baseline,
    BaselineContext,
    BenchNotSupportedError,
    EngineBench,
    ModelSpec,
    OptionalDependencyError,
    ReceiverFleet,
    ReceiverLauncher,
)
from wtcore.bench.runner import BenchOptions, run_bench

__all__ = [
    "Baseline",
    "BaselineContext",
    "BenchNotSupportedError",
    "BenchOptions",
    "EngineBench",
    "ModelSpec",
    "OptionalDependencyError",
    "ReceiverFleet",
    "ReceiverLauncher",
    "run_bench",
]
