"""vLLM workers with tensor parallelism as sharded receivers: each reports its slices and
loads only them.

The layout is read from vLLM's layer classes, which decide what each worker holds; what a rule
cannot describe is refused at startup, naming the layer. Slices are copied into their
parameters inside the layerwise reload, not through vLLM's weight loaders, which narrow whole
tensors by the TP rank themselves. See docs/vllm.md, "Tensor parallelism".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

import torch

from wtcore.errors import PayloadError, ProtocolStateError, TransferError
from wtcore.sharded.layout import split
from wtcore.sharded.receiver_layout import MAX_RULES, TPLayout


class _Adapter(Protocol):
    """The engine, not imported: it imports this module."""

    @property
    def model(self) -> torch.nn.Module: ...


__all__ = ["TPModelSink", "Target", "VLLMLayout", "derive_layout"]


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor's local slice goes: ``module.param``, whole (``offset is
    None``) or rows ``offset .. offset + rows`` (a shard of a fused layer)."""

    module: str
    param: str
    offset: int | None = None
    rows: int | None = None


@dataclass(frozen=True)
class VLLMLayout:
    """A TP worker's report, and where each checkpoint name lands."""

    layout: TPLayout
    targets: Mapping[str, Target]
    kinds: Mapping[str, str] = field(default_factory=dict)


def _escape(name: str) -> str:
    """``name`` as an fnmatch pattern that matches itself only."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _fused_shards(layer: Any, subs: list[str]) -> list[tuple[int, int]]:
    """``(offset, rows)`` of each of ``subs`` inside ``layer``'s local parameter."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        if len(subs) != 3:
            raise PayloadError(f"packed_modules_mapping: a QKV layer fuses 3 shards, got {subs}")
        return [
            (int(layer._get_shard_offset_mapping(s)), int(layer._get_shard_size_mapping(s)))
            for s in ("q", "k", "v")
        ]
    sizes = [int(s) for s in layer.output_partition_sizes]
    if len(sizes) != len(subs):
        raise PayloadError(
            f"packed_modules_mapping: {len(subs)} shards {subs} for a layer of {len(sizes)} outputs"
        )
    return list(zip(accumulate(sizes, initial=0), sizes, strict=False))  # drops the total


def _kinds(layer: Any, name: str, subs: list[str] | None, tp_rank: int, tp_size: int) -> list[str]:
    """The rule of each shard of ``layer`` (one entry, or one per fused shard)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 1 if subs is None else len(subs)
    layer_tp = int(getattr(layer, "tp_size", 1) or 1)
    if layer_tp == 1 or not isinstance(layer, (LinearBase, VocabParallelEmbedding)):
        return ["replicated"] * n
    if layer_tp != tp_size:
        raise PayloadError(
            f"{name!r} ({type(layer).__name__}): split over {layer_tp} ranks, this worker's TP "
            f"group has {tp_size}; a sharded round cannot describe it"
        )
    if isinstance(layer, VocabParallelEmbedding):
        idx = layer.shard_indices
        org = int(layer.org_vocab_size)
        want = split(org, tp_size, tp_rank)
        got = (int(idx.org_vocab_start_index), int(idx.org_vocab_end_index))
        rows = int(layer.num_embeddings_per_partition)
        if int(layer.num_added_embeddings) or got != want or rows != got[1] - got[0]:
            raise PayloadError(
                f"{name!r} ({type(layer).__name__}): vLLM pads the vocabulary of {org} rows to "
                f"{int(layer.num_embeddings_padded)} and gives TP rank {tp_rank} rows "
                f"{got[0]}..{got[1]} of {rows} local rows; a sharded round splits it as torch "
                f"does ({want[0]}..{want[1]}) and cannot send padding. Serve a vocabulary that "
                f"is a multiple of {int(layer.padding_size) * tp_size}, or send whole tensors"
            )
        return ["vocab"] * n
    if isinstance(layer, QKVParallelLinear) and int(layer.num_kv_head_replicas) > 1:
        if int(layer.total_num_kv_heads) != 1:
            raise PayloadError(
                f"{name!r}: {int(layer.total_num_kv_heads)} KV heads over {tp_size} TP ranks, "
                "each held by some ranks only; a sharded round describes KV heads split over "
                "every rank or held whole by each"
            )
        return ["column", "replicated", "replicated"]
    if isinstance(layer, RowParallelLinear):
        return ["row"] * n
    if isinstance(layer, ColumnParallelLinear):
        return ["column"] * n
    return ["replicated"] * n


def _rules(kinds: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """One rule per name with its layer index wildcarded (``model.layers.*.mlp.down_proj.weight``)
    where every name it matches has the same kind, else per name; replicated is the default."""
    import fnmatch

    rules: list[tuple[str, str]] = []
    done: set[str] = set()
    names = list(kinds)
    for name, kind in kinds.items():
        if kind == "replicated" or name in done:
            continue
        pattern = re.sub(r"\.\d+\.", ".*.", _escape(name))
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if pattern != _escape(name) and all(kinds[n] == kind for n in matched):
            rules.append((pattern, kind))
            done.update(matched)
        else:
            rules.append((_escape(name), kind))
            done.add(name)
    return tuple(rules)


def derive_layout(model: torch.nn.Module, tp_rank: int, tp_size: int) -> VLLMLayout:
    """What TP worker ``tp_rank`` of ``tp_size`` holds of ``model`` (a vLLM model), per
    checkpoint name; a ``PayloadError`` naming the layer for what a rule cannot describe."""
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    targets: dict[str, Target] = {}
    kinds: dict[str, str] = {}
    for mname, layer in model.named_modules():
        params = [p for p, t in layer._parameters.items() if t is not None]
        if not params:
            continue
        prefix, _, last = mname.rpartition(".")
        subs = list(packed[last]) if last in packed else None
        layer_kinds = _kinds(layer, mname, subs, tp_rank, tp_size)
        if subs is None:
            for p in params:
                hf = f"{mname}.{p}" if mname else p
                targets[hf] = Target(mname, p)
                kinds[hf] = layer_kinds[0]
            continue
        shards = _fused_shards(layer, subs)
        for p in params:
            for sub, kind, (offset, rows) in zip(subs, layer_kinds, shards, strict=True):
                hf = f"{prefix}.{sub}.{p}" if prefix else f"{sub}.{p}"
                targets[hf] = Target(mname, p, offset, rows)
                kinds[hf] = kind
    rules = _rules(kinds)
    if len(rules) > MAX_RULES:
        raise PayloadError(f"layout: this model needs {len(rules)} rules, at most {MAX_RULES}")
    layout = TPLayout(tp_rank, tp_size, rules)
    for name, kind in kinds.items():
        assert layout.kind(name) == kind, (name, kind, layout.kind(name))
    return VLLMLayout(layout, targets, kinds)


class TPModelSink:
    """A TP worker's sink: a sharded round's slices are copied into their parameters; a
    whole-tensor round goes to the model's ``load_weights``, whose loaders narrow it. The
    adapter sets :attr:`sharded` when the round's plan arrives."""

    accepts_patches = False

    def __init__(self, adapter: _Adapter, derived: VLLMLayout) -> None:
        self._adapter = adapter
        self._model = adapter.model
        self.derived = derived
        self._modules = dict(adapter.model.named_modules())
        #: Set by the adapter for a round whose plan arrived; cleared at each start.
        self.sharded = False
        #: Layers materialized this round and not yet processed.
        self._open: dict[str, torch.nn.Module] = {}
        #: This sharded round's bytes for this worker: its plan's, and what was copied in.
        self.planned_bytes = 0
        self.landed_bytes = 0

    def start(self) -> None:
        self.sharded = False
        self._open.clear()
        self.planned_bytes = self.landed_bytes = 0

    def take_plan(self, planned_bytes: int) -> None:
        """This round is sharded; ``planned_bytes``: this worker's slices, per its plan."""
        self.sharded = True
        self.planned_bytes = planned_bytes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        model: Any = self._adapter.model
        if not self.sharded:
            model.load_weights((n, t.clone()) for n, t in weights)  # copies: see ModelSink
            return
        if model is not self._model:
            raise ProtocolStateError(
                "update_weights: a sharded round into a TP worker loads the main model only "
                "(start_draft_weight_update selected another)"
            )
        with torch.no_grad():
            for name, t in weights:
                self._load(name, t)

    def _load(self, name: str, t: torch.Tensor) -> None:
        from vllm.model_executor.model_loader.reload import layerwise as lw
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        target = self.derived.targets.get(name)
        if target is None:
            raise PayloadError(f"{name!r}: not a checkpoint tensor of this vLLM model")
        layer = self._modules[target.module]
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            raise ProtocolStateError(
                f"{name!r}: layer {target.module!r} is not being reloaded (no round open, or "
                "it already got all its tensors in this round)"
            )
        if target.module not in self._open:
            materialize_layer(layer, info)
            for p in [*layer._parameters.values(), *layer._buffers.values()]:
                if p is not None and hasattr(p, "weight_loader"):
                    p.weight_loader = lw._get_original_loader(p)
            self._open[target.module] = layer
        param: torch.Tensor = getattr(layer, target.param)
        dst = (
            param.data
            if target.offset is None
            else param.data.narrow(0, target.offset, target.rows or 0)
        )
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise PayloadError(
                f"{name!r}: this worker's slice is {list(dst.shape)} {dst.dtype}, got "
                f"{list(t.shape)} {t.dtype}"
            )
        dst.copy_(t)
        self.landed_bytes += t.nbytes
        info.load_numel += t.numel()
        if info.load_numel >= (info.load_numel_total or 0):
            _process(layer, info)
            del self._open[target.module]

    def check_complete(self) -> None:
        """At finish: refuse the round if a layer got some of its slices but not all (vLLM's
        finalize would process it from uninitialized memory)."""
        if self._open:
            names = ", ".join(repr(n) for n in list(self._open)[:5])
            raise TransferError(
                f"layers {names} got only part of their tensors in this sharded round; the "
                "round is failed and no version is published (send every tensor of a layer)"
            )


@torch.no_grad()
def _process(layer: torch.nn.Module, info: Any) -> None:
    """The end of vLLM 0.32's ``_layerwise_process``, after the weights are in: process
    (quantize, repack) and copy into the kernel tensors the running model uses."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import layerwise as lw

    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    method = getattr(layer, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        method.process_weights_after_loading(layer)
        update = getattr(layer, "update_param_tp_status", None)
        if update is not None:
            update()
    if info.kernel_tensors is not None:
        lw._copy_and_restore_kernel_tensors(layer, info)
    info.reset()
