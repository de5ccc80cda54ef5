"""Read and write ``.safetensors`` checkpoints, so ``wtcore serve`` can host a real model.

The format is handled by the ``safetensors`` package (no pickle; it checks every header entry
against the file before it builds a tensor). It is an optional extra,
``pip install 'wtcore-http-client[safetensors]'``, because only ``wtcore serve --safetensors``
needs it: the client side stays a ``requests``-only install. This module only turns the
package's errors into wtcore's and names the extra when the package is missing.
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

#: How to get the optional reader; every "missing package" error ends with it.
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
    """``{name: tensor}`` from a ``.safetensors`` file, on the CPU.

    A malformed file raises :class:`~wtcore.errors.PayloadError` naming the file and the reason.
    """
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
    """Write ``tensors`` (any device, any layout) in the safetensors format.

    Each tensor is copied to a contiguous CPU tensor first: the package refuses non-contiguous
    tensors and tensors sharing storage (tied weights), which a state dict may well contain.
    """
    st = _safetensors_torch()
    plain = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    st.save_file(plain, str(path), metadata=dict(metadata) if metadata else None)
