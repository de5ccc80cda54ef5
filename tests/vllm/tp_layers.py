"""vLLM's real layer classes at TP=2, two processes: what :func:`wtcore_vllm.tp.derive_layout`
makes of them. Run with the vLLM venv's Python: ``python tp_layers.py``; prints one JSON line.

Each process joins vLLM's own TP group (gloo, CPU) as one of 2 ranks and builds a small model
from vLLM's layers (QKV with one KV head and with two, a merged gate/up, a row layer, a
vocabulary of 256 rows, a norm), then derives its layout; a second model with a vocabulary of
200 rows (vLLM pads it to 256 and splits 128 + 72) must be refused. Rank 0 prints what both
ranks got: kinds, each target's offset and rows, the local shape of each tensor by the
layout, the shape vLLM gave the parameter region, and the refusal.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.multiprocessing as mp


def _model(vocab: int, kv_heads: int) -> torch.nn.Module:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = QKVParallelLinear(64, 32, 2, kv_heads, bias=True)
            self.gate_up_proj = MergedColumnParallelLinear(64, [128, 128], bias=False)
            self.down_proj = RowParallelLinear(128, 64, bias=True)
            self.norm = RMSNorm(64)

    class Model(torch.nn.Module):
        packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }

        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(vocab, 64)
            self.layers = torch.nn.ModuleList([Block(), Block()])

    return Model()


#: The checkpoint (global) shapes of the model's tensors, by the name's last two parts.
FULL = {
    "q_proj": (64, 64),
    "k_proj": (32, 64),  # per KV head
    "v_proj": (32, 64),
    "gate_proj": (128, 64),
    "up_proj": (128, 64),
    "down_proj": (64, 128),
    "norm": (64,),
    "embed_tokens": (256, 64),
}


def _full(name: str, kv: int) -> tuple[int, ...]:
    layer, param = name.split(".")[-2:]
    shape = FULL[layer]
    if layer in ("k_proj", "v_proj"):
        shape = (shape[0] * kv, *shape[1:])
    return shape[:1] if param == "bias" else shape


def _run(rank: int, port: int, out: Any) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from wtcore.errors import PayloadError
    from wtcore_vllm.tp import derive_layout

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=2,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=2)
        report: dict[str, Any] = {}
        for kv in (1, 2):
            model = _model(256, kv)
            got = derive_layout(model, rank, 2)
            modules = dict(model.named_modules())
            rows = {}
            for name, t in got.targets.items():
                param = getattr(modules[t.module], t.param)
                region = param if t.offset is None else param.narrow(0, t.offset, t.rows or 0)
                rows[name] = {
                    "kind": got.kinds[name],
                    "offset": t.offset,
                    "rows": t.rows,
                    "region": list(region.shape),
                    "box": [list(d) for d in got.layout.box(name, _full(name, kv))],
                }
            report[f"kv{kv}"] = {"rules": [list(r) for r in got.layout.rules], "targets": rows}
        try:
            derive_layout(_model(200, 1), rank, 2)
            report["vocab200"] = None
        except PayloadError as e:
            report["vocab200"] = str(e)
    out.put((rank, report))


def main() -> None:
    from wtcore.testing import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    print(json.dumps([got[0], got[1]]), flush=True)
    sys.exit(max(p.exitcode or 0 for p in procs))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
