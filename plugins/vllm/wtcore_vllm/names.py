"""How wtcore engine names map onto vLLM backend names (no vLLM import)."""

from __future__ import annotations

from wtcore.errors import PayloadError

__all__ = ["PREFIX", "vllm_backend_name", "wtcore_engine_name"]

#: Every wtcore engine appears in vLLM under this prefix, so that it can never collide with
#: vLLM's own backends of the same name (vLLM has its own ``nccl`` and ``ipc``).
PREFIX = "wtcore_"


def vllm_backend_name(engine: str) -> str:
    """``nccl`` -> ``wtcore_nccl``."""
    return PREFIX + engine


def wtcore_engine_name(backend: str) -> str:
    """``wtcore_nccl`` -> ``nccl``; a name without the prefix is a ``ValueError``."""
    if not backend.startswith(PREFIX) or len(backend) == len(PREFIX):
        raise PayloadError(
            f"weight_transfer_config.backend: expected '{PREFIX}<engine>', got {backend!r}"
        )
    return backend[len(PREFIX) :]
