"""wtcore-mooncake: the ``mooncake`` engine, weights pulled over the Mooncake Transfer Engine.

Registered as ``mooncake`` in ``wtcore.backends`` (:data:`ENGINE`); Mooncake itself is
imported only when an engine is built (:mod:`wtcore_mooncake.te`). See docs/mooncake.md.
"""

from __future__ import annotations

from wtcore.registry import Halves
from wtcore_mooncake.wire import MooncakeInitInfo, MooncakeTrainerInitInfo, MooncakeUpdateInfo

__all__ = ["ENGINE", "MooncakeInitInfo", "MooncakeTrainerInitInfo", "MooncakeUpdateInfo"]

#: ``mooncake`` in ``wtcore.backends``: each registry imports only its own half.
ENGINE = Halves(
    trainer="wtcore_mooncake.trainer:MooncakeTrainerEngine",
    worker="wtcore_mooncake.worker:MooncakeWorkerEngine",
)
