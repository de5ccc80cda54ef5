"""Receivers that the bench starts, through the chosen client's ``ClientBench``, and always
stops; :data:`INPROC` is the in-process client's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore_bench.api import ClientBench, ModelSpec, ReceiverFleet

if TYPE_CHECKING:
    from wtcore.worker import WeightSyncWorker

__all__ = ["INPROC", "InProcessFleet", "ModelSpec", "ReceiverFleet", "launch_fleet"]


class InProcessFleet:
    """Receivers in this process, driven by one fan-out client of ``client_cls``."""

    def __init__(
        self,
        client_cls: type[Any],
        backend: str,
        count: int,
        model: ModelSpec,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> None:
        from wtcore.sink import ModuleSink
        from wtcore.worker import WeightSyncWorker

        self.workers: list[WeightSyncWorker] = [
            WeightSyncWorker(
                backend,
                ModuleSink(model.build_zeros()),
                device=model.device,
                rank=i,
                world_size=count,
                **options,
            )
            for i in range(count)
        ]
        self.client = client_cls(self.workers, timeout_s=timeout_s)

    def pids(self) -> list[int]:
        return [os.getpid()]

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def launch_fleet(
    client: str,
    backend: str,
    count: int,
    model: ModelSpec,
    *,
    timeout_s: float,
    options: Mapping[str, Any] | None = None,
) -> ReceiverFleet:
    """Start ``count`` receivers reachable by the client registered as ``client`` (which must
    be an ``InspectableClient``)."""
    from wtcore.client import InspectableClient, calls_of
    from wtcore.registry import CLIENTS
    from wtcore_bench.support import client_bench

    cls = CLIENTS.load(client)  # unknown name -> the registry's "did you mean" error
    launcher = client_bench(client, cls).launcher
    fleet: ReceiverFleet = launcher(
        cls, backend, count, model, timeout_s=timeout_s, options=dict(options or {})
    )
    if isinstance(fleet.client, InspectableClient):
        return fleet
    fleet.close()
    kind = type(fleet.client)
    missing = [
        n for n in calls_of(InspectableClient) if not callable(getattr(fleet.client, n, None))
    ]
    raise PayloadError(
        f"client {client!r}: the bench needs a wtcore.client.InspectableClient, but its launcher "
        f"returned a {kind.__module__}.{kind.__qualname__}, which lacks {', '.join(missing)}"
    )


#: ``client.inproc`` in ``wtcore.bench``.
INPROC = ClientBench(InProcessFleet)
