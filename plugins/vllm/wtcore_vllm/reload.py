"""vLLM's layerwise reload around one round, with a clean way out of a failed one.

vLLM has no public abort, and its finalize would process half-loaded layers from uninitialized
memory, so :func:`abort_layerwise_reload` puts the old kernel tensors back on every layer not
processed yet: each layer holds its old or its new weights, never a mix or meta tensors.
:func:`check_layerwise_reload` adds what finalize lacks: a layer that got none of its tensors
fails the round (vLLM only logs it), and a tied output layer gets the input embedding's new
weights. See docs/vllm.md, "What the adapter does".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from wtcore.errors import TransferError

__all__ = [
    "TiedLayers",
    "abort_layerwise_reload",
    "check_layerwise_reload",
    "finalize_layerwise_reload",
    "initialize_layerwise_reload",
]

log = logging.getLogger(__name__)


def initialize_layerwise_reload(model: torch.nn.Module) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload as init

    init(model)


@dataclass(frozen=True)
class TiedLayers:
    """Layers fed by a tie to a loaded layer; ``partners[i]`` is the layer whose weight
    ``layers[i]`` takes (``None``: shared storage, nothing to copy)."""

    layers: tuple[torch.nn.Module, ...] = ()
    partners: tuple[torch.nn.Module | None, ...] = ()


def _declared_partner(
    layer: torch.nn.Module, model: torch.nn.Module, model_config: Any, info_map: Any
) -> torch.nn.Module | None:
    """The input embedding that ``layer`` (an output head) is tied to by the model's config,
    if that embedding was loaded this round: processed already, or with some of its elements
    (a padded vocabulary: vLLM processes it in finalize, before the tied head)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if not isinstance(layer, ParallelLMHead) or not getattr(hf, "tie_word_embeddings", False):
        return None
    embeddings = [
        m
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    ]
    if len(embeddings) != 1:
        return None
    partner = embeddings[0]
    info = info_map.get(partner)
    loaded = info is not None and (not info.can_load() or info.load_numel > 0)
    return partner if loaded else None


def check_layerwise_reload(model: torch.nn.Module, model_config: Any = None) -> TiedLayers:
    """Raise if a layer got none of its tensors this round; return the layers fed by a tie.
    Changes nothing, so a round that fails here can still be aborted."""
    from vllm.model_executor.model_loader.reload import layerwise as lw

    info_map = getattr(lw, "LAYERWISE_INFO", None)
    deferred = getattr(lw, "is_deferred_attention_layer", None)
    if info_map is None or deferred is None:
        log.warning("vLLM has no layerwise internals to check; layers are not checked")
        return TiedLayers()
    # Who holds each tensor now: processed layers hold their kernel tensors again, layers
    # still waiting for tensors hold meta tensors.
    holders: dict[int, list[str]] = {}
    for name, layer in model.named_modules(remove_duplicate=False):
        for t in [*layer._parameters.values(), *layer._buffers.values()]:
            if t is not None:
                holders.setdefault(id(t), []).append(name)
    failed: list[str] = []
    tied: list[torch.nn.Module] = []
    partners: list[torch.nn.Module | None] = []
    for name, layer in model.named_modules():
        info = info_map.get(layer)
        if info is None or not info.can_load() or info.kernel_tensors is None:
            continue  # processed this round, or never part of it
        if deferred(layer) or info.load_numel > 0:
            continue  # vLLM processes these in finalize
        wanted = _checkpoint_tensors(info)
        if not wanted:
            continue  # nothing a checkpoint carries (a rotary cache, ...)
        partner = _declared_partner(layer, model, model_config, info_map)
        shared = all(any(h != name for h in holders.get(id(t), ())) for t in wanted)
        if partner is not None or shared:
            if _reprocessable(layer):
                tied.append(layer)
                partners.append(partner)
                continue
            failed.append(f"{name!r} ({type(layer).__name__}, tied to a loaded layer)")
        else:
            failed.append(f"{name!r} ({type(layer).__name__})")
    if failed:
        shown = ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
        raise TransferError(
            f"vLLM loaded none of the tensors of layer {shown} in this round; the round is "
            "failed and no version is published (send every tensor of the model; a tied "
            "tensor that is quantized must be sent under each of its names)"
        )
    return TiedLayers(tuple(tied), tuple(partners))


def _checkpoint_tensors(info: Any) -> list[torch.Tensor]:
    """The layer's tensors a checkpoint carries: parameters and persistent buffers."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    params, buffers = info.kernel_tensors
    skip = set(SKIP_LOAD_TENSORS) | set(info.kernel_non_persistent_buffers)
    return [t for n, t in [*params.items(), *buffers.items()] if n not in skip]


def _reprocessable(layer: torch.nn.Module) -> bool:
    """A layer whose kernel tensors are its checkpoint tensors, so processing is repeatable."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = getattr(layer, "quant_method", None)
    return method is None or isinstance(method, UnquantizedEmbeddingMethod)


@torch.no_grad()
def finalize_layerwise_reload(
    model: torch.nn.Module, model_config: Any, tied: TiedLayers = TiedLayers()
) -> None:
    """vLLM's finalize, after giving the ``tied`` layers their shared (new) tensors back."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload as fin
    from vllm.model_executor.model_loader.reload import layerwise as lw

    for layer in tied.layers:
        info = lw.LAYERWISE_INFO[layer]
        lw._place_kernel_tensors(layer, info)
        info.reset()
    fin(model, model_config)  # type: ignore[no-untyped-call]
    for layer, partner in zip(tied.layers, tied.partners, strict=True):
        if partner is not None:
            mine: torch.Tensor = getattr(layer, "weight")  # noqa: B009 (a Module attribute)
            theirs: torch.Tensor = getattr(partner, "weight")  # noqa: B009
            if mine is not theirs:  # the platform gave the head storage of its own
                if mine.shape != theirs.shape:
                    raise TransferError(
                        f"tied output layer {type(layer).__name__}: its weight is "
                        f"{list(mine.shape)}, the input embedding's {list(theirs.shape)}; send "
                        "the tensor under both names"
                    )
                mine.data.copy_(theirs.data)
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)  # on CPU: prepack the new weights


@torch.no_grad()
def abort_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """Undo :func:`initialize_layerwise_reload` for every layer not yet processed."""
    from vllm.model_executor.model_loader.reload import layerwise as lw

    info_map = getattr(lw, "LAYERWISE_INFO", None)
    place = getattr(lw, "_place_kernel_tensors", None)
    if info_map is None or place is None:
        # A vLLM whose internals moved: finalizing is the documented way back to a usable
        # model, at the cost of processing partially loaded layers.
        log.warning("vLLM has no layerwise internals to abort with; finalizing instead")
        finalize_layerwise_reload(model, model_config)
        return
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = info_map.get(layer)
        if info is None or not info.can_load():
            continue  # processed during the round (new weights) or never touched
        if info.kernel_tensors is not None:
            place(layer, info)  # the original tensors, with their original loaders
        info.reset()
    loading = getattr(lw, "LOADING_LAYERS", None)
    if loading is not None:
        loading.clear()
