"""Source reads: the workers read each tensor where it lies in the trainer's memory.

Real transfer engines (TCP on loopback), real module sinks. A round of CPU tensors is never
packed: every bucket's update names its tensors' regions, the trainer registers their storages
for that bucket only (views of one storage share one registration) and none is left registered
after the round; what cannot be read where it lies (a bucket of more than ``MAX_REGIONS``
tensors, memory Mooncake will not register) is packed into the slots, in the same round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inproc import InProcessClient
from wtcore_mooncake import MooncakeTrainerInitInfo, te
from wtcore_mooncake.wire import MAX_REGIONS

pytestmark = [pytest.mark.timeout(120)]


class RecordingClient(InProcessClient):
    """The in-process client, keeping the form of every bucket update (slot or regions)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forms: list[str] = []

    def update_weights(self, update_info: Any, *args: Any, **kwargs: Any) -> Any:
        self.forms.append("regions" if "regions" in update_info else "slot")
        return super().update_weights(update_info, *args, **kwargs)


def _state(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(32, 16 + i, generator=g) for i in range(n)}
    state["bf16"] = torch.randn(300, generator=g).to(torch.bfloat16)
    state["empty"] = torch.zeros(0)
    return state


def _run(
    source_state: dict[str, torch.Tensor], rounds: list[dict[str, torch.Tensor]], **options: Any
) -> tuple[RecordingClient, Any, WeightSyncWorker]:
    model = build_module(zeros_like_state(rounds[0]))
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    client = RecordingClient(worker, timeout_s=30)
    options = {"packed_buffer_size_bytes": 4096, "source_reads": True, **options}
    info = MooncakeTrainerInitInfo(timeout_s=30, rank=0, **options)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(source_state)
    )
    try:
        for i, fresh in enumerate(rounds):
            for k, v in fresh.items():
                source_state[k].copy_(v)
            trainer.send_weights(weight_version=f"v{i}")
            assert_state_equal(model, fresh)
            lender = te.lender("127.0.0.1", "tcp")
            assert lender.loans == lender.failed == [] and lender.count == {}
    finally:
        trainer.shutdown()
        worker.shutdown()
    return client, trainer, worker


def test_rounds_are_read_where_the_tensors_lie_and_nothing_stays_registered() -> None:
    rounds = [_state(10 + r) for r in range(3)]
    client, _, worker = _run({k: v.clone() for k, v in rounds[0].items()}, rounds)
    buckets = len(
        MooncakeTrainerInitInfo(rank=0, packed_buffer_size_bytes=4096).plan(
            TensorSource(rounds[0]).metadata()
        )
    )
    assert buckets > 1  # several buckets a round, so one is in flight while the next is lent
    assert client.forms == ["regions"] * buckets * 3
    payload = sum(v.nbytes for v in rounds[0].values())
    # every byte read once a round, in place or through staging (the first bucket of a round
    # always through staging: the sink offers its tensors once it knows it is no delta round)
    assert worker.engine.in_place_bytes + worker.engine.staged_bytes == 3 * payload
    assert worker.engine.in_place_bytes > 0


def test_views_of_one_storage_share_one_registration() -> None:
    """Tied weights and a flat buffer's views: their storage is registered once a bucket."""
    flat = torch.randn(4096)
    views = [flat[:1024].view(32, 32), flat[1024:1536], flat[:1024]]
    source_state = {"a": views[0], "b": views[1], "tied": views[2]}
    _run(source_state, [{k: v.clone() for k, v in source_state.items()}])
    lender = te.lender("127.0.0.1", "tcp")
    regions = lender.lend(views)
    assert regions == [[t.data_ptr(), t.nbytes] for t in views]
    assert lender.count == {flat.data_ptr(): 1}
    assert lender.lend([views[1]]) == [[views[1].data_ptr(), views[1].nbytes]]
    assert lender.count == {flat.data_ptr(): 2}  # lent by two buckets, registered once
    lender.give_back(keep=1)
    assert lender.count == {flat.data_ptr(): 1}
    lender.round_failed()  # kept until the next round has ended
    assert lender.count == {flat.data_ptr(): 1} and lender.loans == []
    lender.round_ended()
    assert lender.count == {} and lender.failed == []
    # unregistered: registering it again works (Mooncake refuses overlapping regions)
    assert lender.engine.register_memory(flat.data_ptr(), flat.nbytes) == 0
    assert lender.engine.unregister_memory(flat.data_ptr()) == 0


def test_what_cannot_be_read_where_it_lies_is_packed_in_the_same_round() -> None:
    """A bucket of memory registered already (Mooncake refuses overlapping regions) and a
    bucket of more than ``MAX_REGIONS`` tensors go packed; the others still as regions; and
    the registration the trainer did not make is left alone."""
    held = torch.randn(64, 64)  # 16 KiB, a bucket of its own; registered by someone else here
    many = {f"t{i:03d}": torch.randn(2) for i in range(MAX_REGIONS + 1)}
    big = torch.randn(2048)  # 8 KiB: a bucket of its own
    source_state = {"held": held, **many, "big": big}
    fresh = {k: v.clone() + 1 for k, v in source_state.items()}
    options = {"packed_buffer_size_bytes": 1 << 20, "direct_min_bytes": 8192}
    plan = MooncakeTrainerInitInfo(rank=0, **options).plan(TensorSource(fresh).metadata())
    assert [len(b.metas) for b in plan] == [1, MAX_REGIONS + 1, 1]
    te_engine, _ = te.start("127.0.0.1", "tcp")
    assert te_engine.register_memory(held.data_ptr(), held.nbytes) == 0
    try:
        client, _, _ = _run(source_state, [fresh], **options)
        assert client.forms == ["slot", "slot", "regions"]  # held; the 257 small ones; big
        # still registered: registering it again is refused as overlapping
        assert te_engine.register_memory(held.data_ptr(), held.nbytes) != 0
    finally:
        assert te_engine.unregister_memory(held.data_ptr()) == 0


def test_source_reads_off_packs_every_bucket() -> None:
    rounds = [_state(20)]
    client, _, _ = _run({k: v.clone() for k, v in rounds[0].items()}, rounds, source_reads=False)
    assert client.forms and set(client.forms) == {"slot"}
