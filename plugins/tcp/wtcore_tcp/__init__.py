"""wtcore-tcp: packed, pipelined weight streams over plain TCP, for CPU workers (docs/tcp.md).

Registered as ``tcp`` in ``wtcore.backends`` (:data:`ENGINE`). Importing it imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtcore.registry import Halves
from wtcore_tcp.config import TCPInitInfo, TCPTrainerInitInfo, TCPUpdateInfo

if TYPE_CHECKING:
    from wtcore_tcp.trainer import TCPTrainerEngine
    from wtcore_tcp.worker import TCPWorkerEngine

__all__ = [
    "ENGINE",
    "TCPInitInfo",
    "TCPTrainerEngine",
    "TCPTrainerInitInfo",
    "TCPUpdateInfo",
    "TCPWorkerEngine",
]

#: ``tcp`` in ``wtcore.backends``: each registry imports only its own half.
ENGINE = Halves(
    trainer="wtcore_tcp.trainer:TCPTrainerEngine", worker="wtcore_tcp.worker:TCPWorkerEngine"
)


def __getattr__(name: str) -> Any:
    # The engines are imported on first use, like the registries do.
    if name == "TCPTrainerEngine":
        from wtcore_tcp.trainer import TCPTrainerEngine

        return TCPTrainerEngine
    if name == "TCPWorkerEngine":
        from wtcore_tcp.worker import TCPWorkerEngine

        return TCPWorkerEngine
    raise AttributeError(f"module 'wtcore_tcp' has no attribute {name!r}")
