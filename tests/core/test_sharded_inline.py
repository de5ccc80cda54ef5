"""Sharded rounds on the inline engine: the sharded contract suite, and what is inline's own.

The suite (:mod:`wtcore.testing.sharded_contract`) runs real trainer processes in a gloo
group into real receivers holding TP slices. Here too: a round whose relay drops one rank's
buckets (and says all went well) is never published, and a plan made for another layout is
refused before anything is applied.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError, ReceiverError
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout
from wtcore.sharded.receiver_layout import TPLayout
from wtcore.testing.sharded import PartsSource
from wtcore.testing.sharded_contract import (
    BUFFER,
    RULES,
    ShardedContractSuite,
    expected_slices,
    held_parts,
    receivers,
    run_ranks,
    whole,
)
from wtcore_kit.inline import InlineTrainerEngine, InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient


def inline_info(rank: int, buffer_size_bytes: int, receivers: int) -> InlineTrainerInitInfo:
    return InlineTrainerInitInfo(rank=rank, packed_buffer_size_bytes=buffer_size_bytes)


class TestInlineSharded(ShardedContractSuite):
    backend = "inline"
    trainer_info = staticmethod(inline_info)


class DroppingClient(InProcessClient):
    """Rank 0's client, relaying everything but trainer rank 1's buckets (and saying all went
    well): the receivers' own count must refuse to publish."""

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, list):
            update_info = [
                {"buckets": [b for b in e["buckets"] if b["src"] != 1]} for e in update_info
            ]
        super().update_weights(update_info)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_round_a_trainer_rank_cuts_short_is_never_published() -> None:
    got = run_ranks(inline_info, "inline", 2, 2, "S0", client_cls=DroppingClient)
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
    from wtcore.sharded.plan import PlannedRound
    from wtcore.sharded.receiver_layout import receiver_layouts

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


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_staged_sharded_round_prepares_every_slice_before_any_commit() -> None:
    got = run_ranks(inline_info, "inline", 2, 2, "S0", staged=True)
    assert all("error" not in g for g in got), got
    infos, exact = got[0]["infos"], got[0]["exact"]
    assert all(all(e.values()) for e in exact)  # every slice bit-exact after the commit
    for info in infos:
        assert (info["weight_version"], info["consistent"]) == ("sharded-1", True)
        assert info["staged_s"] is not None and info["paused_s"] == info["commit_s"]
