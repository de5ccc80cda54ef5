"""``wtcore bench --plan-only``: a sharded round's planning at scale, with no processes.

Why without processes: what planning costs one rank (time, memory) is what decides whether a
sharded round scales to a thousand trainer ranks, and it needs no network to measure. So the
layouts are simulated, as the ranks would have them (the trainer's from its DTensors, the
receivers' from their reports), and one trainer rank and one receiver plan their own parts
exactly as a round does (:func:`~wtcore.sharded.round.run_sharded_round`, and a receiver's
:meth:`~wtcore.sharded.plan.PlannedRound.from_wire` of the plan it is sent). Each side is
timed, then run again under ``tracemalloc`` for its peak (which slows it, so apart).

Layouts: ``dense``, a 70B-like model (80 layers, bf16), FSDP (``Shard(0)``) over the trainer
ranks, into TP=8 receivers (vLLM's rules, :data:`wtcore_bench.sharded.RULES`) in replicas;
``moe``, a 235B-A22B-like model (94 layers, 128 experts, each projection of a layer's experts
one ``[expert, out, in]`` tensor, as torchtitan and vLLM hold them): FSDP + EP on the trainer
(a mesh of 8 EP groups, ``Shard(0)`` over experts, then FSDP's ``Shard(1)`` within a group)
and TP + EP on the receivers (a ``column`` rule on the experts: each TP rank holds 16 experts
whole). Fewer than 8 ranks, or counts 8 does not divide, use the largest common divisor.
"""

from __future__ import annotations

import json
import math
import time
import tracemalloc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from wtcore.meta import ParamMeta
    from wtcore.sharded.layout import Layout

__all__ = ["LAYOUTS", "plan_layout", "print_plan_table", "run_plan_bench"]

LAYOUTS = ("dense", "moe")

#: Each tensor's metadata, trainer layout and receiver layout.
Tensors = list[tuple["ParamMeta", "Layout", "Layout"]]


def plan_layout(layout: str, trainer_ranks: int, receivers: int) -> tuple[Tensors, list[Any]]:
    """Every tensor of ``layout``'s model with its trainer layout (a fresh one per tensor, as a
    sharded source gives them) and its receiver layout, and the receivers' reports."""
    import torch

    from wtcore.meta import ParamMeta
    from wtcore.sharded.layout import Layout, Shard
    from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
    from wtcore_bench.sharded import RULES

    m, n, dense = trainer_ranks, receivers, layout == "dense"
    hidden, layers, vocab, kv = (8192, 80, 128256, 1024) if dense else (4096, 94, 151936, 512)
    ep = 1 if dense else math.gcd(8, m)  # the trainer's EP groups, of m // ep ranks each
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (8192, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, 8192),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
        if dense:
            shapes |= {f"{p}.mlp.{k}_proj.weight": (28672, hidden) for k in ("gate", "up")}
            shapes[f"{p}.mlp.down_proj.weight"] = (hidden, 28672)
        else:  # the router (replicated), and each projection of the 128 experts as one tensor
            shapes |= {f"{p}.self_attn.{k}_norm.weight": (128,) for k in ("q", "k")}
            shapes[f"{p}.mlp.gate.weight"] = (128, hidden)
            shapes |= {f"{p}.mlp.experts.{k}_proj": (128, 1536, hidden) for k in ("gate", "up")}
            shapes[f"{p}.mlp.experts.down_proj"] = (128, hidden, 1536)
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    metas = [ParamMeta(k, torch.bfloat16, s) for k, s in shapes.items()]
    tp = math.gcd(8, n)  # experts split over the TP ranks whole: EP over the TP group
    reports = [TPLayout(r % tp, tp, (("*.mlp.experts.*", "column"), *RULES)) for r in range(n)]
    dst = receiver_layouts(reports, metas)
    # FSDP over every rank; experts over the EP groups, then FSDP within one (its dim 1)
    fsdp, experts = ((m,), (Shard(0),)), ((ep, m // ep), (Shard(0), Shard(1)))
    return [
        (
            meta,
            Layout.placed(meta.shape, *(experts if ".experts." in meta.name else fsdp)),
            dst[meta.name],
        )
        for meta in metas
    ], reports


def _measure(fn: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    """``fn``'s wall and CPU seconds (this process's: what a busy host does not inflate),
    then its peak of Python allocations (a second run, under tracemalloc)."""
    wall, cpu = time.perf_counter(), time.process_time()
    got = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"plan_s": wall, "cpu_s": cpu, "peak_mib": peak / 2**20}, got


def _side(plan: Any, cost: dict[str, float], src: int | None, dst: int | None) -> dict[str, Any]:
    per_pair = [sum(c.nbytes for c in plan.pair(s, d)) for s, d in plan.pairs(src=src, dst=dst)]
    return {
        "rank": src if dst is None else dst,
        **cost,
        "pairs": len(per_pair),
        "chunks": len(plan.select(src=src, dst=dst)),
        "bytes": sum(per_pair),
        "busiest_link_bytes": max(per_pair, default=0),
    }


def run_plan_bench(layout: str, trainer_ranks: int, receivers: int) -> dict[str, Any]:
    """Plan ``layout`` as trainer rank 0 (which also encodes the plan it sends) and as
    receiver 0 (which decodes it); the record of both."""
    from wtcore.sharded.plan import PlannedRound
    from wtcore.sharded.receiver_layout import receiver_layouts

    tensors, reports = plan_layout(layout, trainer_ranks, receivers)
    metas = [meta for meta, _, _ in tensors]

    def trainer() -> tuple[Any, dict[str, Any]]:
        # what rank 0 derives from the reports, its part of the plan, and the plan it sends
        dst = receiver_layouts(reports, metas)
        planned = PlannedRound.make(metas, {m.name: s for m, s, _ in tensors}, dst)
        planned.plan.select(src=0)
        return planned.plan, planned.to_wire()

    t_cost, (t_plan, wire) = _measure(trainer)

    def receiver() -> Any:
        planned = PlannedRound.from_wire(wire)
        planned.plan.select(dst=0)
        return planned.plan

    r_cost, r_plan = _measure(receiver)
    return {
        "ok": True,
        "layout": layout,
        "trainer_ranks": trainer_ranks,
        "receivers": receivers,
        "tensors": len(metas),
        "model_bytes": sum(m.nbytes for m in metas),
        "wire_bytes": len(json.dumps(wire)),
        "plan_s": t_cost["plan_s"],
        "trainer": _side(t_plan, t_cost, 0, None),
        "receiver": _side(r_plan, r_cost, None, 0),
    }


def print_plan_table(record: dict[str, Any], out: TextIO) -> None:
    r = record
    out.write(
        f"wtcore bench --plan-only: {r['layout']}, {r['trainer_ranks']} trainer ranks -> "
        f"{r['receivers']} receivers, {r['tensors']} tensors, {r['model_bytes'] / 2**30:.1f} "
        f"GiB; the plan sent: {r['wire_bytes'] / 2**20:.2f} MiB\n"
    )
    heads = ("plan s", "cpu s", "peak MiB", "pairs", "chunks", "GiB", "busiest GiB")
    out.write(f"{'side':<12}" + "".join(f"{h:>12}" for h in heads) + "\n")
    for side in ("trainer", "receiver"):
        x = r[side]
        cells = (
            f"{x['plan_s']:.3f}",
            f"{x['cpu_s']:.3f}",
            f"{x['peak_mib']:.1f}",
            x["pairs"],
            x["chunks"],
            f"{x['bytes'] / 2**30:.3f}",
            f"{x['busiest_link_bytes'] / 2**30:.4f}",
        )
        out.write(f"{side + ' ' + str(x['rank']):<12}" + "".join(f"{c:>12}" for c in cells) + "\n")
