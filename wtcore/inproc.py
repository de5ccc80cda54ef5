"""``inproc``: a client that drives receivers living in this process.

A single :class:`~wtcore.worker.WeightSyncWorker` is already a client; this one fans out to
several, concurrently, so that engines whose worker calls block until the trainer sends
(broadcasts, rendezvous) can be tested and benchmarked in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wtcore.fanout import fan_out
from wtcore.worker import WeightSyncWorker

__all__ = ["InProcessClient"]


class InProcessClient:
    """Fan-out ``WeightSyncClient`` over in-process workers."""

    def __init__(
        self, workers: WeightSyncWorker | Sequence[WeightSyncWorker], *, timeout_s: float = 60.0
    ) -> None:
        self.workers = [workers] if isinstance(workers, WeightSyncWorker) else list(workers)
        if not self.workers:
            raise ValueError("InProcessClient needs at least one worker")
        self.timeout_s = timeout_s

    def _each(self, call: str, *args: Any) -> list[Any]:
        targets = [
            (f"worker[rank={w.rank}]", lambda w=w: getattr(w, call)(*args)) for w in self.workers
        ]
        return fan_out(call, targets, timeout_s=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", weight_version)

    def weight_info(self) -> list[dict[str, Any]]:
        return [w.weight_info() for w in self.workers]

    def checksums(self) -> list[dict[str, str]]:
        return self._each("checksums")

    def get_world_size(self) -> int:
        return len(self.workers)
