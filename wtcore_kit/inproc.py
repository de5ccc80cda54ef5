"""``inproc``: a client that drives receivers living in this process.

A single :class:`~wtcore.worker.WeightSyncWorker` is already a
:class:`~wtcore.client.WeightSyncClient`; this one fans out to several, concurrently, so that
engines whose worker calls block until the trainer sends (broadcasts, rendezvous) can be
tested and benchmarked in one process, and it adds the inspection calls
(:class:`~wtcore.client.InspectableClient`) with the same shapes as the HTTP and Ray clients.
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
    """Fan-out client over in-process workers, in the order given.

    ``close()`` leaves the workers running: they belong to the caller.
    """

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
