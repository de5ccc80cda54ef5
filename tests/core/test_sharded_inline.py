"""Sharded rounds on the inline engine: every trainer rank sends only its part, every receiver
gets only its slice, bit-exact.

Trainer ranks are real processes in a gloo group (rank 0 hosts the receivers, real
``WeightSyncWorker`` s holding only their TP slices, behind an ``InProcessClient``). Each case
checks three things: every receiver's tensors against the whole tensors' slices
(``torch.equal``); the bytes each trainer rank packed and sent against its planned chunks;
the bytes each receiver counted as landed against its slice. A round a trainer rank cuts
short is never published, and a plan made for another layout is refused before anything is
applied.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.errors import PayloadError, ReceiverError
from wtcore.inline import InlineTrainerEngine, InlineTrainerInitInfo
from wtcore.inproc import InProcessClient
from wtcore.layout import Layout, Replicate, Shard
from wtcore.meta import ParamMeta
from wtcore.receiver_layout import TPLayout
from wtcore.source import HeldSource
from wtcore.synthetic import build_module
from wtcore.testing import on_ranks
from wtcore.testing.sharded import PartsSource

RULES = (("*.qkv.weight", "column"), ("*.out.*", "row"), ("embed.weight", "vocab"))
SHAPES = {
    "embed.weight": (11, 6),
    "layers.0.qkv.weight": (9, 6),
    "layers.0.out.weight": (6, 7),
    "layers.0.out.bias": (6,),
    "layers.1.qkv.weight": (9, 6),
    "norm.weight": (6,),
}
#: A small bucket, so that every pair travels in several.
BUFFER = 160


def whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out["layers.1.qkv.weight"] = out["layers.1.qkv.weight"].to(torch.bfloat16)
    return out


def trainer_layouts(kind: str, m: int) -> dict[str, Layout]:
    full = whole()
    if kind == "2d":  # FSDP x TP on a 2 x 2 mesh
        return {
            n: Layout.placed(t.shape, (2, 2), (Shard(0), Shard(t.dim() - 1)))
            for n, t in full.items()
        }
    placement = {"S0": Shard(0), "R": Replicate()}.get(kind)
    out = {}
    for n, t in full.items():
        p = placement if placement is not None else Shard(min(1, t.dim() - 1))  # S1 (1-D: S0)
        out[n] = Layout.placed(t.shape, (m,), (p,))
    return out


def receivers(n: int, tp: bool) -> list[WeightSyncWorker]:
    full = whole()
    out = []
    for r in range(n):
        lay = TPLayout(r, n, RULES) if tp else None
        held = {k: torch.zeros_like(lay.local(k, t) if lay else t) for k, t in full.items()}
        sink = ModuleSink(build_module(held), layout=lay)
        out.append(WeightSyncWorker("inline", sink, rank=r, world_size=n))
    return out


def held_parts(w: WeightSyncWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in w.sink.module.named_parameters()}  # type: ignore[attr-defined]


def source_for(kind: str, m: int, rank: int) -> Any:
    full = whole()
    if kind == "pipe":  # stage 0 holds the embedding and layer 0; stage 1 the rest
        names = list(full)
        mine = names[:4] if rank == 0 else names[4:]
        return HeldSource([ParamMeta.of(k, t) for k, t in full.items()], {k: full[k] for k in mine})
    return PartsSource(full, trainer_layouts(kind, m), rank)


def _trainer_main(
    rank: int, port: int, q: Any, m: int, n: int, kind: str, tp: bool, cut: bool
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=m, timeout=datetime.timedelta(seconds=60))
    engine = None
    try:
        fleet = receivers(n, tp) if rank == 0 else []
        client_cls = DroppingClient if cut else InProcessClient
        client = client_cls(fleet, timeout_s=60) if rank == 0 else None
        engine = InlineTrainerEngine.trainer_init(
            InlineTrainerInitInfo(rank=rank, packed_buffer_size_bytes=BUFFER), client=client
        )
        try:
            stats = engine.send_weights(source_for(kind, m, rank), weight_version="sharded-1")
            result: dict[str, Any] = {"sent": stats.bytes_sent, "planned": stats.num_bytes}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        result["rank"] = rank
        if rank == 0:
            result["infos"] = [w.weight_info() for w in fleet]
            # compared here: tensors put on a queue may outlive the process that shares them
            want = expected_slices(n, tp)
            result["exact"] = [
                {k: torch.equal(held_parts(w)[k], t) for k, t in want[r].items()}
                for r, w in enumerate(fleet)
            ]
        q.put(result)
    finally:
        if engine is not None:
            engine.shutdown()
        dist.destroy_process_group()


class DroppingClient(InProcessClient):
    """Rank 0's client, relaying everything but trainer rank 1's buckets (and saying all went
    well): the receivers' own count must refuse to publish."""

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, list):
            update_info = [
                {"buckets": [b for b in e["buckets"] if b["src"] != 1]} for e in update_info
            ]
        super().update_weights(update_info)


def run(m: int, n: int, kind: str, *, tp: bool = True, cut: bool = False) -> list[dict[str, Any]]:
    got = on_ranks(_trainer_main, m, m, n, kind, tp, cut, timeout_s=150)
    return sorted(got, key=lambda x: x["rank"])


def expected_slices(n: int, tp: bool) -> list[dict[str, torch.Tensor]]:
    full = whole()
    if not tp:
        return [full for _ in range(n)]
    return [{k: TPLayout(r, n, RULES).local(k, t) for k, t in full.items()} for r in range(n)]


CASES = [
    (1, 2, "S0", True),
    (2, 1, "S0", False),  # FSDP into one whole replica (M -> 1), no gather anywhere
    (2, 2, "S0", True),
    (2, 3, "S1", True),
    (3, 2, "R", True),
    (2, 2, "pipe", True),
    (4, 2, "2d", True),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("m", "n", "kind", "tp"), CASES, ids=[f"{m}to{n}-{k}" for m, n, k, _ in CASES]
)
def test_each_rank_sends_its_part_and_each_receiver_gets_its_slice(
    m: int, n: int, kind: str, tp: bool
) -> None:
    from wtcore.plan import PlannedRound
    from wtcore.receiver_layout import receiver_layouts

    got = run(m, n, kind, tp=tp)
    assert all("error" not in g for g in got), got
    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    src = source_for(kind, m, 0).layouts() if kind != "pipe" else _pipe_layouts(m)
    reports = [TPLayout(r, n, RULES) if tp else None for r in range(n)]
    plan = PlannedRound.make(metas, src, receiver_layouts(reports, metas)).plan
    for g in got:
        # what each rank packed and sent is exactly its planned chunks
        assert g["sent"] == g["planned"] == plan.nbytes(src=g["rank"]), g["rank"]
    assert sum(g["sent"] for g in got) == sum(
        t.nbytes for s in expected_slices(n, tp) for t in s.values()
    )
    want = expected_slices(n, tp)
    for r, (info, exact) in enumerate(zip(got[0]["infos"], got[0]["exact"], strict=True)):
        assert info["consistent"] and info["weight_version"] == "sharded-1", info
        slice_bytes = sum(t.nbytes for t in want[r].values())
        assert info["round_bytes"] == {"planned": slice_bytes, "landed": slice_bytes}, r
        assert exact == dict.fromkeys(want[r], True), r  # bit-exact, every tensor


def _pipe_layouts(m: int) -> dict[str, Layout]:
    names = list(whole())
    full = whole()
    return {
        k: Layout.whole(full[k].shape, owner=0 if i < 4 else 1, world_size=m)
        for i, k in enumerate(names)
    }


@pytest.mark.timeout(300)
def test_a_round_a_trainer_rank_cuts_short_is_never_published() -> None:
    got = run(2, 2, "S0", cut=True)
    for g in got:  # every rank fails, with the receivers' reason
        assert "round incomplete on receiver" in g["error"], g
        assert "sending rank 1" in g["error"], g
    for info in got[0]["infos"]:
        assert not info["consistent"] and info["weight_version"] is None, info


# ---------------------------------------------------------------- one trainer rank, in process


def test_one_rank_into_tp_slices_in_process() -> None:
    fleet = receivers(2, True)
    full = whole()
    engine = InlineTrainerEngine.trainer_init(
        InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=BUFFER),
        client=InProcessClient(fleet, timeout_s=60),
    )
    src = PartsSource(full, {k: Layout.whole(t.shape) for k, t in full.items()}, 0)
    stats = engine.send_weights(src, weight_version="v1")
    # every receiver's slice, the replicated tensors once per receiver
    assert stats.bytes_sent == sum(t.nbytes for s in expected_slices(2, True) for t in s.values())
    for r, w in enumerate(fleet):
        for k, t in expected_slices(2, True)[r].items():
            assert torch.equal(held_parts(w)[k], t), (r, k)
    engine.shutdown()


def test_a_plan_for_another_layout_is_refused_before_anything_is_applied() -> None:
    """A trainer that planned receiver 1 as TP rank 0 (a stale or forged report): the
    receiver checks the plan's boxes against what it holds and refuses the round."""
    from wtcore.plan import PlannedRound
    from wtcore.receiver_layout import receiver_layouts

    fleet = receivers(2, True)
    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    wrong = receiver_layouts([TPLayout(0, 2, RULES), TPLayout(0, 2, RULES)], metas)
    planned = PlannedRound.make(metas, {k: Layout.whole(t.shape) for k, t in full.items()}, wrong)
    client = InProcessClient(fleet, timeout_s=60)
    client.init_weight_transfer_engine({"packed_buffer_size_bytes": BUFFER})
    client.start_weight_update()
    before = held_parts(fleet[1])
    with pytest.raises(ReceiverError, match=r"worker\[rank=1\].*'embed.weight' was planned as"):
        client.update_weights({"plan": planned.to_wire()})
    assert all(torch.equal(before[k], v) for k, v in held_parts(fleet[1]).items())
    assert (
        not fleet[1].weight_info()["consistent"] or fleet[1].weight_info()["weight_version"] is None
    )


def test_a_sharded_source_needs_an_engine_that_executes_plans() -> None:
    with pytest.raises(PayloadError, match="verify: not supported for a sharded source"):
        InlineTrainerEngine.trainer_init(
            InlineTrainerInitInfo(rank=0), client=InProcessClient(receivers(1, False))
        ).send_weights(PartsSource(whole(), {}, 0), verify=True)
