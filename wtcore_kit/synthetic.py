"""Synthetic models: a transformer-like state dict of a given size, and modules holding it.

Both ends build the same model from a few numbers (size, tensor count, dtype, seed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["build_module", "synthetic_state", "zeros_like_state"]


def synthetic_state(
    total_bytes: int, num_tensors: int = 300, dtype: str = "float32", seed: int = 0
) -> dict[str, torch.Tensor]:
    """A transformer-like state dict of about ``total_bytes`` in about ``num_tensors`` tensors
    (9 per layer, plus the embedding, the final norm and the LM head)."""
    import torch

    dt = getattr(torch, dtype)
    es = torch.empty((), dtype=dt).element_size()
    layers = max(1, (num_tensors - 3) // 9)
    # bytes ~= es * (layers * (4 H^2 + 3 * H * 2.75H) + 2 * 8H * H)
    h = int(math.sqrt(max(total_bytes, 1) / es / (layers * 12.25 + 16)))
    h = max(8, h // 8 * 8)
    inter = max(8, int(h * 2.75) // 8 * 8)
    vocab = 8 * h
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.self_attn.{x}_proj.weight", (h, h)) for x in "qkvo"]
        shapes += [(f"{p}.mlp.{x}_proj.weight", (inter, h)) for x in ("gate", "up")]
        shapes += [(f"{p}.mlp.down_proj.weight", (h, inter))]
        shapes += [(f"{p}.{x}_layernorm.weight", (h,)) for x in ("input", "post_attention")]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dt) for name, shape in shapes}


def zeros_like_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    return {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in state.items()}


def build_module(state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``named_parameters()`` are exactly ``state`` (dotted names nest)."""
    import torch

    root = torch.nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None) if part in mod._modules else None
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root
