"""One local Ray cluster for the whole session, plus sinks the receiver actors build.

Ray starts once (a few seconds and ~800 MiB here) and is always shut down. Actors ask for
``num_cpus=0`` so that several fit on this 2-core machine.

pytest's importlib mode gives test modules names that Ray's workers cannot import, so the
helpers the actors run (sink factories, actor subclasses) are registered to be pickled by
value: the workers get the code itself, not an import path.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from wtcore.sink import ModuleSink
from wtcore.testing import sources
from wtcore_ray_client import WeightSyncActor


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # pragma: no cover - another suite started one
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def register_by_value(module_name: str) -> None:
    """Make Ray ship ``module_name``'s functions and classes by value to its workers."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[module_name])


register_by_value(__name__)


# ---------------------------------------------------------------------- sinks built in actors
def module_sink(seed: int, drop: str | None = None) -> Any:
    """A ModuleSink over zeros shaped like ``make_state(seed)``; ``drop`` leaves one name out."""
    from wtcore.testing import build_module, zeros_like_state

    state = make_state(seed)
    if drop is not None:
        state.pop(drop)
    return ModuleSink(build_module(zeros_like_state(state)))


#: Small but varied: every common dtype, 0-d and empty tensors, plus a few larger float32
#: layers: :func:`wtcore.testing.make_state`'s ``"wide"``.
make_state = functools.partial(sources.make_state, kind="wide")


class BlockingSink:
    """Holds ``load_weights`` for ``hold_s`` (a stuck model load); otherwise a ModuleSink."""

    def __init__(self, seed: int, hold_s: float) -> None:
        self.inner = module_sink(seed)
        self.hold_s = hold_s

    def named_tensors(self) -> Any:
        return self.inner.named_tensors()

    def load_weights(self, weights: Any) -> None:
        time.sleep(self.hold_s)
        self.inner.load_weights(weights)


class InferenceActor(WeightSyncActor):
    """A user's own inference actor with the receiver mixed in (the model lives here)."""

    def __init__(self, seed: int, backend: str, *, rank: int, world_size: int) -> None:
        self.model = module_sink(seed).module  # stands in for the served model
        self.setup_weight_sync(
            backend, lambda: ModuleSink(self.model), rank=rank, world_size=world_size
        )

    def held_tensors(self) -> dict[str, tuple[str, list[int], bytes]]:
        """Every parameter as (dtype, shape, raw bytes): exact, and bf16-safe (no numpy dtype)."""
        import torch

        out = {}
        for name, t in self.model.named_parameters():
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = (str(t.dtype).split(".")[-1], list(t.shape), raw)
        return out


def tensors_from_held(held: dict[str, tuple[str, list[int], bytes]]) -> dict[str, Any]:
    import torch

    out = {}
    for name, (dtype, shape, raw) in held.items():
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = flat.view(getattr(torch, dtype)).reshape(shape)
    return out


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers above, for test modules (importlib mode cannot import conftest by name)."""
    return SimpleNamespace(
        module_sink=module_sink,
        make_state=make_state,
        BlockingSink=BlockingSink,
        InferenceActor=InferenceActor,
        tensors_from_held=tensors_from_held,
    )
