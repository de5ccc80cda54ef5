"""wtcore-ray-client: the Ray control plane (client ``ray``, the :class:`WeightSyncActor`
receiver and :func:`launch_receivers`). Importing it does not import Ray; see docs/ray.md.
"""

from __future__ import annotations

from wtcore_ray_client.actor import SinkFactory, WeightSyncActor
from wtcore_ray_client.client import DEFAULT_TIMEOUT_S, RayWeightSyncClient, actor_label
from wtcore_ray_client.launch import ReceiverFleet, launch_receivers, old_fleet_name

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RayWeightSyncClient",
    "ReceiverFleet",
    "SinkFactory",
    "WeightSyncActor",
    "actor_label",
    "launch_receivers",
]


__getattr__ = old_fleet_name(__name__)
