"""HeldSource: pipeline or expert ownership, each rank holding some tensors whole.

In one process the checks on what a rank says it holds; then two real processes in a gloo
group, each a pipeline stage (a tied embedding held by both): both ranks learn the same
layouts, plan alike, and the plan run by the reference executor gives a whole replica and
two TP slices, bit-exact, each rank sending only what it holds.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.sharded import HeldSource
from wtcore.testing import on_ranks

SHAPES = {
    "embed.weight": (10, 4),
    "layers.0.weight": (4, 4),
    "layers.1.weight": (4, 4),
    "head.weight": (10, 4),
}
#: Which stage holds what: the embedding is tied, so both stages hold it.
STAGES = {
    0: ("embed.weight", "layers.0.weight"),
    1: ("layers.1.weight", "embed.weight", "head.weight"),
}


def whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def metas() -> list[ParamMeta]:
    return [ParamMeta.of(n, t) for n, t in whole().items()]


def test_one_rank_holding_everything_is_the_whole_case() -> None:
    full = whole()
    src = HeldSource(metas(), full)
    assert src.held_names() == list(SHAPES)
    for name, lay in src.layouts().items():
        assert lay.boxes == (tuple((0, d) for d in SHAPES[name]),)
    got = dict(src)
    assert all(torch.equal(got[n], t) for n, t in full.items())


def test_what_a_rank_holds_is_checked_against_the_metadata() -> None:
    full = whole()
    with pytest.raises(PayloadError, match="'extra' is not in the model's metadata"):
        HeldSource(metas(), {"extra": torch.zeros(2)})
    with pytest.raises(PayloadError, match="'head.weight'"):
        HeldSource(metas(), {"head.weight": full["head.weight"].double()})
    with pytest.raises(PayloadError, match="listed twice"):
        HeldSource(metas() + metas()[:1], {})
    with pytest.raises(
        PayloadError, match="held by no trainer rank: 'layers.1.weight', 'head.weight' \\(2 of 4"
    ):
        HeldSource(metas(), {n: full[n] for n in STAGES[0]}).layouts()


def _stage_main(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from wtcore.sharded.layout import tp_layout
    from wtcore.sharded.plan import plan_transfer
    from wtcore.testing.sharded import execute_plan, part

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        full = whole()
        src = HeldSource(metas(), {n: full[n].clone() for n in STAGES[rank]})
        layouts = src.layouts()
        sent = [name for name, _ in src]
        out = []
        for kind, n in (("replicated", 1), ("column", 2)):
            dst = {m.name: tp_layout(m.shape, kind, n) for m in metas()}
            plan = plan_transfer([(m, layouts[m.name], dst[m.name]) for m in metas()])
            parts, got = execute_plan(full, plan, layouts, dst)
            exact = all(
                torch.equal(p, part(full[name], dst[name].boxes[r]))
                for (name, r), p in parts.items()
            )
            out.append((kind, plan.digest(), plan.nbytes(src=rank), exact, got))
        results.put((rank, sent, {k: v.boxes for k, v in layouts.items()}, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_pipeline_stages_plan_alike_and_send_only_what_they_hold() -> None:
    got = sorted(on_ranks(_stage_main, 2))
    (_, sent0, boxes0, out0), (_, sent1, boxes1, out1) = got
    assert sent0 == ["embed.weight", "layers.0.weight"]  # metadata order, held names only
    assert sent1 == ["embed.weight", "layers.1.weight", "head.weight"]
    assert boxes0 == boxes1  # both ranks learned the same layouts
    full4x4, full10x4 = ((0, 4), (0, 4)), ((0, 10), (0, 4))
    assert boxes0["embed.weight"] == (full10x4, full10x4)
    assert boxes0["layers.0.weight"] == (full4x4, None)
    assert boxes0["head.weight"] == (None, full10x4)
    total = sum(t.nbytes for t in whole().values())
    for (kind, d0, b0, exact0, got0), (_, d1, b1, exact1, got1) in zip(out0, out1, strict=True):
        assert d0 == d1, kind  # the same plan on both ranks
        assert exact0 and exact1, kind
        assert got0 == got1
        assert b0 + b1 == total == sum(got0.values()), kind  # every element once
        # each stage sends its own layers; the tied embedding comes from one of them per receiver
        assert b0 >= 4 * 4 * 4 and b1 >= (4 * 4 + 10 * 4) * 4, kind
