"""wtcore-nccl: packed, pipelined broadcast of weights over a process group of its own.

NCCL for CUDA devices, gloo for CPU. The trainer half is registered as ``nccl`` in
``wtcore.trainer_engines``, the worker half as ``nccl`` in ``wtcore.engines``. Importing this
package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtcore_nccl.config import (
    DEFAULT_BUFFER_SIZE,
    DEFAULT_TIMEOUT_S,
    TRANSPORTS,
    NCCLInitInfo,
    NCCLTrainerInitInfo,
    NCCLUpdateInfo,
)

if TYPE_CHECKING:
    from wtcore_nccl.trainer import NCCLTrainerEngine
    from wtcore_nccl.worker import NCCLWorkerEngine

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_TIMEOUT_S",
    "TRANSPORTS",
    "NCCLInitInfo",
    "NCCLTrainerEngine",
    "NCCLTrainerInitInfo",
    "NCCLUpdateInfo",
    "NCCLWorkerEngine",
]


def __getattr__(name: str) -> Any:
    # The engines are imported on first use, like the registries do.
    if name == "NCCLTrainerEngine":
        from wtcore_nccl.trainer import NCCLTrainerEngine

        return NCCLTrainerEngine
    if name == "NCCLWorkerEngine":
        from wtcore_nccl.worker import NCCLWorkerEngine

        return NCCLWorkerEngine
    raise AttributeError(f"module 'wtcore_nccl' has no attribute {name!r}")
