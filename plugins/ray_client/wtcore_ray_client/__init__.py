"""wtcore-ray-client: the Ray control plane for wtcore.

* :class:`RayWeightSyncClient` (client ``ray`` in ``wtcore.clients``) fans every protocol call
  out to receiver actors and raises one :class:`wtcore.ReceiverError` naming each failing one.
* :class:`WeightSyncActor` is the receiver: a plain class to turn into a Ray actor or mix into
  an inference actor; it serves a core :class:`wtcore.WeightSyncWorker`.
* :func:`launch_receivers` starts N receiver actors with resource options; the
  :class:`ReceiverFleet` it returns stops them (``ReceiverGroup`` before 0.2.0: the old name
  still works, with a warning, until 0.3).

Importing this package does not import Ray; the client and the launcher import it when used.
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
