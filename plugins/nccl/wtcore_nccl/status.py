"""What this host can run, for ``wtcore plugins``."""

from __future__ import annotations

__all__ = ["host_status"]


def host_status() -> str:
    """One line: is NCCL usable here, and is the gloo CPU path available."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is a dependency
        return f"unavailable: cannot import torch ({e})"
    if not dist.is_available():
        return "unavailable: this torch build has no torch.distributed"
    gloo = "gloo CPU path available" if dist.is_gloo_available() else "no gloo"
    if not torch.cuda.is_available():
        return f"CUDA not available; {gloo}"
    nccl = "NCCL available" if dist.is_nccl_available() else "NCCL not built into torch"
    return f"{torch.cuda.device_count()} CUDA device(s), {nccl}; {gloo}"
