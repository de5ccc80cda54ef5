"""The generic baselines every engine is measured against, and helpers for writing one.

Absolute numbers on shared machines are noise; ratios taken in one run are not, so every
engine is set against ``memcpy`` (a limit: one single-threaded copy) and ``file`` (naive:
``torch.save``, ``torch.load``, copy) in the same run. Figures are GB/s, medians.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from wtcore_bench.api import Baseline, BaselineContext, BaselineSession

if TYPE_CHECKING:
    import torch

__all__ = [
    "GENERIC_BASELINES",
    "copy_session",
    "file_gbps",
    "median_gbps",
    "memcpy_gbps",
    "session_gbps",
]


def median_gbps(nbytes: int, run: Callable[[], object], repeats: int) -> float:
    """GB/s of the median of ``repeats`` timed calls of ``run`` moving ``nbytes`` each."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


@contextlib.contextmanager
def copy_session(buffer: Any, nbytes: int) -> Iterator[Callable[[], object]]:
    """Single-threaded copies of ``nbytes`` out of ``buffer``, one per call; no view of
    ``buffer`` survives the exit, so it can be closed."""
    import numpy as np
    import torch

    seg = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=nbytes))
    seg.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(seg)  # fault the pages in first
    views = [dst, seg]  # cleared on exit: nothing then refers to ``buffer``
    del dst, seg

    def copy() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            views[0].copy_(views[1])
        finally:
            torch.set_num_threads(threads)

    try:
        yield copy
    finally:
        views.clear()


def session_gbps(session: BaselineSession, ctx: BaselineContext, repeats: int = 3) -> float:
    """A baseline's ``measure`` from its ``session``: a warm-up call, then the median."""
    with session(ctx) as run:
        run()
        return median_gbps(ctx.nbytes, run, repeats)


def _memcpy_session(ctx: BaselineContext) -> AbstractContextManager[Callable[[], object]]:
    return copy_session(bytearray(max(ctx.nbytes, 1)), ctx.nbytes)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    with copy_session(bytearray(max(nbytes, 1)), nbytes) as run:
        return median_gbps(nbytes, run, repeats)


def file_gbps(state: Mapping[str, torch.Tensor], repeats: int = 2) -> float:
    import torch

    from wtcore_kit.synthetic import zeros_like_state

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    model = zeros_like_state(state)
    with tempfile.TemporaryDirectory(prefix="wtcore-bench-") as d:
        path = os.path.join(d, "weights.pt")

        def run() -> None:
            torch.save(dict(state), path)
            loaded = torch.load(path, weights_only=True)  # tensors only: never unpickle code
            for name, t in model.items():
                t.copy_(loaded[name])

        return median_gbps(nbytes, run, repeats)


#: Measured for every engine.
GENERIC_BASELINES: dict[str, Baseline] = {
    "memcpy": Baseline(
        "single-thread memcpy",
        lambda ctx: session_gbps(_memcpy_session, ctx),
        session=_memcpy_session,
    ),
    "file": Baseline("torch.save -> torch.load -> copy", lambda ctx: file_gbps(ctx.state)),
}
