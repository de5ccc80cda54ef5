"""Receivers declare their expert placement and change it between rounds, without a restart.

A toy MoE (8 experts, a router and an embedding) on 2 trainer processes in a gloo group
(expert parallel: each rank holds 4 experts whole; the dense tensors FSDP ``Shard(0)``) into
3 real ``WeightSyncWorker`` receivers (inline engine), each holding only its experts, some of
them redundant copies. Round 1 under one placement, then every receiver re-places
(``ModuleSink.place``) and round 2 runs under the new one: each copy bit-exact, each receiver
planned and landed exactly the bytes it holds, no byte of an expert it does not hold, and
``consistent`` false between the re-placement and the round that writes the new experts.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout, Shard
from wtcore.sharded.plan import PlannedRound
from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
from wtcore.testing.net import on_ranks
from wtcore.testing.sharded import PartsSource
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient
from wtcore_kit.synthetic import build_module

EXPERTS = 8
#: Which experts each receiver holds, per round: 0-3, 4-7 and copies of 0, 1 and 6; then
#: every receiver's set changes, with other redundant copies (2, 5 and 7).
PLACEMENTS = ([{0, 1, 2, 3}, {4, 5, 6, 7}, {0, 1, 6}], [{0, 4, 5, 7}, {1, 2, 3, 6}, {2, 5, 7}])


def model(seed: int) -> dict[str, torch.Tensor]:
    """The toy MoE's tensors, whole: a different seed per round."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(10, 4, generator=g)}
    out["layers.0.mlp.gate.weight"] = torch.randn(EXPERTS, 4, generator=g)
    for e in range(EXPERTS):
        out[f"layers.0.mlp.experts.{e}.w1.weight"] = torch.randn(6, 4, generator=g)
        out[f"layers.0.mlp.experts.{e}.w2.weight"] = torch.randn(4, 6, generator=g)
    return out


def placement(experts: set[int]) -> TPLayout:
    """A receiver's layout: its experts whole, every other expert absent, the rest whole."""
    held = [(f"*.experts.{e}.*", "replicated") for e in sorted(experts)]
    return TPLayout(0, 1, (*held, ("*.experts.*", "absent")))


def trainer_layouts() -> dict[str, Layout]:
    """Expert parallel over 2 ranks (experts 0-3 on rank 0), the dense tensors Shard(0)."""
    out = {}
    for n, t in model(1).items():
        if ".experts." in n:
            out[n] = Layout.whole(t.shape, owner=int(n.split(".")[4]) // 4, world_size=2)
        else:
            out[n] = Layout.placed(t.shape, (2,), (Shard(0),))
    return out


def held(lay: TPLayout, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in full.items() if lay.kind(n) != "absent"}


def _rank(rank: int, port: int, q: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    fleet: list[WeightSyncWorker] = []
    if rank == 0:  # the receivers start holding their experts of round 1, zeros
        for r, experts in enumerate(PLACEMENTS[0]):
            lay = placement(experts)
            module = build_module({n: torch.zeros_like(t) for n, t in held(lay, model(1)).items()})
            sink = ModuleSink(module, layout=lay)
            fleet.append(WeightSyncWorker("inline", sink, rank=r, world_size=3))
    client = InProcessClient(fleet, timeout_s=60) if rank == 0 else None
    info = InlineTrainerInitInfo(rank=rank, packed_buffer_size_bytes=96)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
    out: dict[str, Any] = {"rank": rank, "sent": [], "rounds": []}
    try:
        for i, places in enumerate(PLACEMENTS, start=1):
            full = model(i)
            if rank == 0 and i > 1:  # re-place: keep the experts still held, zeros for new ones
                for w, experts in zip(fleet, places, strict=True):
                    sink = w.sink
                    assert isinstance(sink, ModuleSink)
                    was = dict(sink.module.named_parameters())
                    lay = placement(experts)
                    new = {
                        n: (was[n] if n in was else torch.zeros_like(t)).detach().clone()
                        for n, t in held(lay, full).items()
                    }
                    sink.place(build_module(new), lay)
                out["between"] = [w.weight_info()["consistent"] for w in fleet]
            src = PartsSource(full, trainer_layouts(), rank)
            stats = engine.send_weights(src, weight_version=f"r{i}")
            out["sent"].append(stats.bytes_sent)
            if rank == 0:
                metas = [ParamMeta.of(n, t) for n, t in full.items()]
                lays = [placement(e) for e in places]
                plan = PlannedRound.make(metas, trainer_layouts(), receiver_layouts(lays, metas))
                got = []
                for r, w in enumerate(fleet):
                    want = held(lays[r], full)
                    params = dict(w.sink.module.named_parameters())  # type: ignore[attr-defined]
                    info_r = w.weight_info()
                    got.append(
                        {
                            "names": sorted(params) == sorted(want),
                            "exact": all(torch.equal(params[n], t) for n, t in want.items()),
                            "bytes": sum(t.nbytes for t in want.values()),
                            "planned": plan.plan.nbytes(dst=r),
                            "plan_names": {c.name for c in plan.plan.select(dst=r)} == set(want),
                            "round_bytes": info_r["round_bytes"],
                            "state": (info_r["weight_version"], info_r["consistent"]),
                        }
                    )
                out["rounds"].append(got)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        engine.shutdown()
        for w in fleet:
            w.shutdown()
        q.put(out)
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_every_copy_of_every_expert_follows_a_placement_that_changes() -> None:
    ranks = sorted(on_ranks(_rank, 2, timeout_s=90), key=lambda x: x["rank"])
    assert all("error" not in r for r in ranks), ranks
    rounds = ranks[0]["rounds"]
    assert len(rounds) == 2
    for i, got in enumerate(rounds, start=1):
        for r, g in enumerate(got):
            assert g["names"] and g["exact"] and g["plan_names"], (i, r, g)
            # exactly what it holds: planned, landed, and no byte of an expert it does not hold
            assert g["planned"] == g["bytes"], (i, r, g)
            assert g["round_bytes"] == {"planned": g["bytes"], "landed": g["bytes"]}, (i, r, g)
            assert g["state"] == (f"r{i}", True), (i, r, g)
        # every copy once: the trainer ranks sent the receivers' holdings, no more
        assert sum(rk["sent"][i - 1] for rk in ranks) == sum(g["bytes"] for g in got)
    # re-placed receivers hold experts no round wrote yet: not consistent until round 2
    assert ranks[0]["between"] == [False, False, False]
