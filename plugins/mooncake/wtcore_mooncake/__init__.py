"""wtcore-mooncake: the ``mooncake`` engine, weights pulled over the Mooncake Transfer Engine.

The trainer registers its staging buffers with Mooncake and announces them; each worker reads
every bucket with one ``transfer_sync_read`` (TCP anywhere, RDMA where the hosts have HCAs).
Mooncake itself is imported only when an engine is built (:mod:`wtcore_mooncake.te`).
"""

from __future__ import annotations

from wtcore_mooncake.wire import MooncakeInitInfo, MooncakeTrainerInitInfo, MooncakeUpdateInfo

__all__ = ["MooncakeInitInfo", "MooncakeTrainerInitInfo", "MooncakeUpdateInfo"]
