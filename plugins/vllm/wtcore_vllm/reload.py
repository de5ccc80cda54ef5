"""vLLM's layerwise reload, bracketing one round, with a clean way out of a failed round.

vLLM keeps weights in a kernel format (on CPU, linear weights are repacked for oneDNN), so a
checkpoint-format tensor cannot be copied into a parameter. Its layerwise reload puts each layer
back into checkpoint format (on the meta device), buffers the loaded tensors of that layer until
it is complete, then processes them and copies the result into the original kernel tensors.
vLLM's own NCCL engine initializes it in ``start_weight_update`` and finalizes it in
``finish_weight_update``; so does the adapter.

A round that fails midway must not leave layers on the meta device (the server would crash on
its next request) nor half-buffered layers (the next round's counts would start from the wrong
number and process a layer before all its new tensors arrived). vLLM has no public abort, and
finalizing would process partially loaded layers with uninitialized memory, so
:func:`abort_layerwise_reload` puts the untouched kernel tensors back on every layer that was
not yet processed: each layer then holds either its old or its new weights, never a mix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["abort_layerwise_reload", "finalize_layerwise_reload", "initialize_layerwise_reload"]

log = logging.getLogger(__name__)


def initialize_layerwise_reload(model: torch.nn.Module) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload as init

    init(model)


def finalize_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload as fin

    fin(model, model_config)  # type: ignore[no-untyped-call]


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
