"""vLLM's ``/weight_checker`` on CPU: checksums of the weights the kernels compute with.

vLLM's CPU backend packs each unquantized linear weight into its GEMM kernel's own handle
(leaving an empty parameter), and the output layer computes from a packed copy, so vLLM's
checksum and reset miss most of a model. No tensor holds the packed weights, so they are read
back through the kernel: its GEMM applied to the identity gives the transposed weight bit for
bit (only a zero's sign is lost; an infinite weight makes its row NaN). Reset packs zeros.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["install", "kernel_digests", "zero_kernel_weights"]

#: Elements of one probe's output: bounds the memory a readback takes (16 MiB in fp32).
_PROBE_ELEMENTS = 1 << 22


def install() -> None:
    """Point vLLM 0.32's worker-module checksum and reset at the functions below."""
    from vllm.v1.worker import gpu_worker

    gpu_worker.compute_tensor_digests = kernel_digests
    gpu_worker.zero_weights = zero_kernel_weights


def _packed(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """Layers whose GEMM reads a packed copy: an emptied linear weight, or an output layer."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    unquantized = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    for name, layer in model.named_modules():
        weight = getattr(layer, "weight", None)
        if (
            hasattr(layer, "cpu_linear")
            and isinstance(weight, torch.Tensor)
            and isinstance(getattr(layer, "quant_method", None), unquantized)
            and (weight.numel() == 0 or isinstance(layer, ParallelLMHead))
        ):
            yield name, layer


def _shape(layer: Any) -> tuple[int, int]:
    if layer.weight.numel():
        return int(layer.weight.shape[0]), int(layer.weight.shape[1])
    return int(layer.output_size_per_partition), int(layer.input_size_per_partition)


@torch.no_grad()
def _digest(layer: Any) -> str:
    """SHA-256 of the weight the layer's kernel holds, transposed (input x output)."""
    out, k = _shape(layer)
    rows, dtype = max(1, _PROBE_ELEMENTS // out), layer.weight.dtype
    h = hashlib.sha256()
    for start in range(0, k, rows):
        n = min(rows, k - start)
        probe = torch.zeros(n, k, dtype=dtype)
        probe[:, start : start + n] = torch.eye(n, dtype=dtype)
        got = layer.cpu_linear(probe, layer.weight, None)
        h.update(got.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def kernel_digests(model: torch.nn.Module) -> dict[str, str]:
    """vLLM's digests, each packed layer's weight read back through its kernel."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    digests: dict[str, str] = compute_tensor_digests(model)
    for name, layer in _packed(model):
        digests[f"{name}.weight"] = _digest(layer)  # a tied head gets a key of its own
    return digests


@torch.no_grad()
def zero_kernel_weights(model: torch.nn.Module) -> None:
    """vLLM's reset, then each packed layer repacked from zeros."""
    from vllm.model_executor.model_loader.weight_checksum import zero_weights

    zero_weights(model)
    for _, layer in list(_packed(model)):
        if layer.weight.numel() == 0:
            zeros = torch.zeros(_shape(layer), dtype=layer.weight.dtype)
            layer.weight = torch.nn.Parameter(zeros, requires_grad=False)
        layer.quant_method.process_weights_after_loading(layer)
