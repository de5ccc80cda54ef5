"""wtcore-ipc: colocated weight handoff with no pickle.

POSIX shared memory on CPU (tested), CUDA IPC handles encoded as JSON on GPU (untested on a
GPU so far). Registered as ``ipc`` in ``wtcore.backends`` (:data:`ENGINE`, naming both halves).
Importing this package imports neither torch nor pybase64; the engines do, when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtcore.registry import Halves

__all__ = [
    "ENGINE",
    "IPCInitInfo",
    "IPCTrainerEngine",
    "IPCTrainerInitInfo",
    "IPCUpdateInfo",
    "IPCWorkerEngine",
    "SharedWeights",
    "share_weights",
]

if TYPE_CHECKING:
    from wtcore_ipc.shared import SharedWeights, share_weights
    from wtcore_ipc.trainer import IPCTrainerEngine
    from wtcore_ipc.wire import IPCInitInfo, IPCTrainerInitInfo, IPCUpdateInfo
    from wtcore_ipc.worker import IPCWorkerEngine

#: ``ipc`` in ``wtcore.backends``: each registry imports only its own half.
ENGINE = Halves(
    trainer="wtcore_ipc.trainer:IPCTrainerEngine", worker="wtcore_ipc.worker:IPCWorkerEngine"
)

_WHERE = {
    "IPCInitInfo": "wtcore_ipc.wire",
    "IPCTrainerInitInfo": "wtcore_ipc.wire",
    "IPCUpdateInfo": "wtcore_ipc.wire",
    "IPCTrainerEngine": "wtcore_ipc.trainer",
    "IPCWorkerEngine": "wtcore_ipc.worker",
    "SharedWeights": "wtcore_ipc.shared",
    "share_weights": "wtcore_ipc.shared",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'wtcore_ipc' has no attribute {name!r}")
