"""Synthetic models and sources for tests and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from wtcore.meta import ParamMeta
from wtcore.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = [
    "MISMATCH_KINDS",
    "MismatchedSource",
    "build_module",
    "mixed_dtype_state",
    "synthetic_state",
    "zeros_like_state",
]

#: The ways :class:`MismatchedSource` can disagree with its metadata.
MISMATCH_KINDS: tuple[str, ...] = ("reordered", "redtyped", "reshaped", "missing", "extra")


def synthetic_state(
    total_bytes: int, num_tensors: int = 300, dtype: str = "float32", seed: int = 0
) -> dict[str, torch.Tensor]:
    """A transformer-like state dict of about ``total_bytes`` in about ``num_tensors`` tensors.

    Per layer: q, k, v, o projections, gate/up/down MLP and two norms (9 tensors), plus the
    embedding, the final norm and the LM head.
    """
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
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (h, h)),
            (f"{p}.self_attn.v_proj.weight", (h, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dt) for name, shape in shapes}


def mixed_dtype_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors of every common dtype, including 0-d and empty ones."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "f32.weight": torch.randn(4, 5, generator=g),
        "bf16.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "f16.weight": torch.randn(16, generator=g).to(torch.float16),
        "i64.index": torch.randint(-(2**40), 2**40, (5,), generator=g, dtype=torch.int64),
        "bool.mask": torch.rand(6, generator=g) > 0.5,
        "scalar.zero_d": torch.randn((), generator=g),
        "empty.weight": torch.empty(0, 3),
        "big.weight": torch.randn(64, 64, generator=g),
    }


def zeros_like_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeros with the same names, shapes and dtypes (contiguous)."""
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


class MismatchedSource(WeightSource):
    """Wraps a source so that iteration disagrees with metadata in one way (``kind``)."""

    def __init__(self, inner: WeightSource, kind: str) -> None:
        if kind not in MISMATCH_KINDS:
            raise ValueError(f"kind must be one of {MISMATCH_KINDS}, got {kind!r}")
        self.inner = inner
        self.kind = kind

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        items = list(self.inner)
        if len(items) < 2:
            raise ValueError("MismatchedSource needs at least two tensors")
        last = len(items) - 1
        if self.kind == "reordered":
            items[last - 1], items[last] = items[last], items[last - 1]
        elif self.kind == "redtyped":
            name, t = items[last]
            other = torch.float64 if t.dtype != torch.float64 else torch.float32
            items[last] = (name, t.to(other))
        elif self.kind == "reshaped":
            name, t = items[last]
            items[last] = (name, t.reshape(-1, 1) if t.dim() != 2 else t.reshape(-1))
        elif self.kind == "missing":
            items.pop()
        elif self.kind == "extra":
            items.append(("extra.weight", torch.zeros(3)))
        return iter(items)
