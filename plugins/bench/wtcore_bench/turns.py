"""Baselines measured in turns with the engine's rounds (``wtcore bench --interleave``): on a
shared host a limit moves by a third from one minute to the next, so each is timed right before
every engine round."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from wtcore_bench.api import OptionalDependencyError

if TYPE_CHECKING:
    from wtcore_bench.api import Baseline, BaselineContext

__all__ = ["Turns"]


class Turns:
    """The open sessions of the baselines measured in turns, and the seconds of each call."""

    def __init__(self, runs: Mapping[str, Callable[[], object]]) -> None:
        self._runs = dict(runs)
        self.seconds: dict[str, list[float]] = {name: [] for name in runs}

    @classmethod
    @contextlib.contextmanager
    def open(
        cls, baselines: Mapping[str, Baseline], ctx: BaselineContext, skipped: dict[str, str]
    ) -> Iterator[Turns]:
        """Set up every baseline's session (one untimed warm-up call each); one whose package
        is missing joins ``skipped``."""
        with contextlib.ExitStack() as stack:
            runs: dict[str, Callable[[], object]] = {}
            for name, b in baselines.items():
                assert b.session is not None
                try:
                    run = stack.enter_context(b.session(ctx))
                except OptionalDependencyError as e:
                    skipped[name] = str(e)
                    continue
                run()
                runs[name] = run
            yield cls(runs)

    def run_each(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, run in self._runs.items():
            t0 = time.perf_counter()
            run()
            out[name] = time.perf_counter() - t0
            self.seconds[name].append(out[name])
        return out

    def gbps(self, nbytes: int) -> dict[str, float]:
        return {n: nbytes / statistics.median(s) / 1e9 for n, s in self.seconds.items() if s}
