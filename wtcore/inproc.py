"""``inproc``: a client that drives receivers living in this process.

A single :class:`~wtcore.worker.WeightSyncWorker` is already a client; this one fans out to
several, concurrently, so that engines whose worker calls block until the trainer sends
(broadcasts, rendezvous) can be tested and benchmarked in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from wtcore.fanout import FanOutClient
from wtcore.worker import WeightSyncWorker

__all__ = ["InProcessClient"]


class InProcessClient(FanOutClient):
    """Fan-out ``WeightSyncClient`` over in-process workers."""

    def __init__(
        self, workers: WeightSyncWorker | Sequence[WeightSyncWorker], *, timeout_s: float = 60.0
    ) -> None:
        self.workers = [workers] if isinstance(workers, WeightSyncWorker) else list(workers)
        if not self.workers:
            raise ValueError("InProcessClient needs at least one worker")
        self.timeout_s = timeout_s

    def _targets(self, call: str, *args: Any) -> list[tuple[str, Callable[[], Any]]]:
        return [
            (f"worker[rank={w.rank}]", functools.partial(getattr(w, call), *args))
            for w in self.workers
        ]

    def weight_info(self) -> list[dict[str, Any]]:
        return [w.weight_info() for w in self.workers]

    def get_world_size(self) -> int:
        return len(self.workers)

    bench_launcher: ClassVar[str] = "wtcore.bench.fleet:InProcessFleet"  # wtcore bench
