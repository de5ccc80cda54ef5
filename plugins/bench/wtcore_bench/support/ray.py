"""``wtcore bench --client ray``: start the bench's receivers as Ray actors.

``client.ray`` in ``wtcore.bench`` launches :class:`RayFleet` (its client is the group's own
:class:`RayWeightSyncClient`). Ray is started here (a local cluster, ``num_cpus=2``, no
dashboard) unless the process is already connected to one, and stopped again by
:meth:`RayFleet.close` only if it was started here (:class:`RaySession`). On ``--device cuda``
each actor asks Ray for an equal share of one GPU (Ray hides GPUs from actors that ask none).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

__all__ = ["RayFleet", "RaySession"]


class RaySession:
    """A Ray connection for the bench: a local cluster started here unless one is connected.

    :meth:`stop` shuts Ray down only if :meth:`start` started it, so a caller already inside a
    Ray job (or a test session's cluster) keeps its own.
    """

    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            self.started = True

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


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
        from wtcore_ray_client.launch import launch_receivers

        self._ray = RaySession()
        self._ray.start()
        on_gpu = str(model.device).startswith("cuda")
        try:
            self.group = launch_receivers(
                count,
                backend,
                functools.partial(_zeros_sink, model),
                device=model.device,
                num_cpus=0,
                num_gpus=1 / count if on_gpu else None,
                worker_options=dict(options),
                ready_timeout_s=timeout_s,
            )
            self.client = self.group.client(timeout_s=timeout_s)
        except BaseException:
            self._ray.stop()
            raise

    def pids(self) -> list[int]:
        return [int(i["pid"]) for i in self.client.identities()]

    def close(self) -> None:
        try:
            self.group.shutdown()
        finally:
            self._ray.stop()
