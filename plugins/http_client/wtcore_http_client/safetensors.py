"""Read and write ``.safetensors`` checkpoints, so ``wtcore serve`` can host a real model.

``safetensors`` is an optional extra (only ``wtcore serve --safetensors`` needs it); this module
turns its errors into wtcore's and names the extra when it is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError, PluginLoadError

if TYPE_CHECKING:
    import torch

__all__ = ["INSTALL_HINT", "load_safetensors", "save_safetensors"]

INSTALL_HINT = "pip install 'wtcore-http-client[safetensors]'"


def _safetensors_torch() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError as e:
        raise PluginLoadError(
            f"reading or writing .safetensors files needs the safetensors package: {INSTALL_HINT}"
        ) from e
    return safetensors.torch


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from a ``.safetensors`` file, on the CPU."""
    st = _safetensors_torch()
    from safetensors import SafetensorError

    p = Path(path)
    if not p.is_file():
        raise PayloadError(f"{p}: no such safetensors file")
    try:
        tensors: dict[str, torch.Tensor] = st.load_file(p, device="cpu")
    except SafetensorError as e:
        raise PayloadError(f"{p}: not a valid safetensors file ({e})") from None
    return tensors


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` as contiguous CPU copies: the package refuses non-contiguous tensors
    and shared storage (tied weights)."""
    st = _safetensors_torch()
    plain = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    st.save_file(plain, str(path), metadata=dict(metadata) if metadata else None)
