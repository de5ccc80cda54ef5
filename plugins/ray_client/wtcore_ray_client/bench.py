"""``wtcore bench --client ray``: start the bench's receivers as Ray actors.

``RayWeightSyncClient.bench_launcher`` names :class:`RayFleet` (its client is the group's own
:class:`RayWeightSyncClient`). Ray is started here (a local cluster, ``num_cpus=2``, no
dashboard) unless the process is already connected to one, and stopped again by
:meth:`RayFleet.close` only if it was started here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

__all__ = ["RayFleet"]


def _zeros_sink(model: Any) -> Any:
    """Built inside each actor, so the receiver's model lives there."""
    from wtcore.sink import ModuleSink

    return ModuleSink(model.build_zeros())


class RayFleet:
    """Receiver actors for the bench, with the client that drives them."""

    def __init__(
        self,
        client_cls: type[Any],
        backend: str,
        count: int,
        model: Any,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> None:
        import ray

        from wtcore_ray_client.launch import launch_receivers

        self._started_ray = False
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        try:
            self.group = launch_receivers(
                count,
                backend,
                functools.partial(_zeros_sink, model),
                num_cpus=0,
                worker_options=dict(options),
                ready_timeout_s=timeout_s,
            )
            self.client = self.group.client(timeout_s=timeout_s)
        except BaseException:
            self._stop_ray()
            raise

    def pids(self) -> list[int]:
        return [int(i["pid"]) for i in self.client.identities()]

    def close(self) -> None:
        try:
            self.group.shutdown()
        finally:
            self._stop_ray()

    def _stop_ray(self) -> None:
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
