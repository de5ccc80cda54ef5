"""``inproc``: a client over receivers in this process.

It calls them concurrently, so engines whose worker calls block until the trainer sends run
in one process, and adds the inspection calls a bare worker lacks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import PayloadError
from wtcore.worker import WeightSyncWorker
from wtcore_kit.fanout import FanOutClient, Target, receiver_args

__all__ = ["InProcessClient"]


class InProcessClient(FanOutClient):
    """Fan-out client over in-process workers, in the order given (the caller's to close)."""

    def __init__(
        self,
        workers: WeightSyncWorker | Sequence[WeightSyncWorker],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.workers = [workers] if isinstance(workers, WeightSyncWorker) else list(workers)
        if not self.workers:
            raise PayloadError("workers: InProcessClient needs at least one worker")
        self.timeout_s = timeout_s

    def _targets(self, call: str, *args: Any, **kwargs: Any) -> list[Target[Any]]:
        return [
            (
                f"worker[rank={w.rank}]",
                functools.partial(getattr(w, call), *receiver_args(args, i), **kwargs),
            )
            for i, w in enumerate(self.workers)
        ]

    def get_world_size(self) -> int:
        return len(self.workers)
