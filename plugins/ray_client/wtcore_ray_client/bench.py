"""``wtcore bench --client ray``: start the bench's receivers as Ray actors.

Implements the core's ``wtcore_launch_receivers`` hook. Ray is started here (a local cluster,
``num_cpus=2``, no dashboard) unless the process is already connected to one, and stopped again
by :meth:`RayFleet.close` only if it was started here.
"""

from __future__ import annotations

import functools
from typing import Any

from wtcore.hookspecs import hookimpl

__all__ = ["RayFleet", "wtcore_launch_receivers"]


def _zeros_sink(model: Any) -> Any:
    """Built inside each actor, so the receiver's model lives there."""
    from wtcore.sink import ModuleSink

    return ModuleSink(model.build_zeros())


class RayFleet:
    """Receiver actors for the bench, with the client that drives them."""

    def __init__(
        self, backend: str, count: int, model: Any, timeout_s: float, options: dict[str, Any]
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
                worker_options=options,
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


@hookimpl
def wtcore_launch_receivers(
    client: str, backend: str, count: int, model: Any, timeout_s: float, options: dict[str, Any]
) -> RayFleet | None:
    if client != "ray":
        return None
    return RayFleet(backend, count, model, timeout_s, options)
