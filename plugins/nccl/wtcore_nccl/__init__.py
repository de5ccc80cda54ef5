"""wtcore-nccl: packed, pipelined broadcast of weights over a process group of its own.

NCCL for CUDA devices, gloo for CPU. Registered as ``nccl`` in ``wtcore.backends``
(:data:`ENGINE`, naming both halves). Importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from wtcore.registry import Halves
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
    "ENGINE",
    "TRANSPORTS",
    "NCCLInitInfo",
    "NCCLTrainerEngine",
    "NCCLTrainerInitInfo",
    "NCCLUpdateInfo",
    "NCCLWorkerEngine",
]

#: ``nccl`` in ``wtcore.backends``: each registry imports only its own half.
ENGINE = Halves(
    trainer="wtcore_nccl.trainer:NCCLTrainerEngine", worker="wtcore_nccl.worker:NCCLWorkerEngine"
)


def __getattr__(name: str) -> Any:
    # The engines are imported on first use, like the registries do.
    for module, _, cls in (half.partition(":") for half in (ENGINE.trainer, ENGINE.worker)):
        if name == cls:
            return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module 'wtcore_nccl' has no attribute {name!r}")
