"""Shared weights (``share_weights``): the trainer's tensors live in shared memory and each
round is one copy, straight out of them, in every worker process. Real worker processes, real
shared memory; the announcement is hostile input like any other."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError, ReceiverError, TransferError
from wtcore_ipc import share_weights
from wtcore_ipc.shm import CANCELLED

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def _updates(client: Any) -> list[dict[str, Any]]:
    return [p for c, p in client.calls if c == "update_weights"]


def test_rounds_copy_straight_out_of_shared_weights(two_workers: list[Any], procs: Any) -> None:
    """Two worker processes, rounds of in-place changes: bit-exact every round, one
    ``update_weights`` per round that names offsets (no ring), and the trainer stages nothing."""
    state = procs.make_state(21)
    for w in two_workers:
        w.setup(state)
    with share_weights(state) as shared:
        trainer, client = procs.trainer_for(two_workers, state, packed_buffer_size_bytes=4096)
        try:
            for r in range(3):
                procs.bump(state)
                stats = trainer.send_weights(weight_version=f"s{r}")
                for w in two_workers:
                    procs.assert_bit_exact(w.dump(), state)
                    info = w.call("weight_info")
                    assert info["consistent"] is True and info["weight_version"] == f"s{r}"
                assert stats.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
            updates = _updates(client)
            assert len(updates) == 3, "one update_weights per round, for both workers"
            assert all(u["segment"] == shared.name and "offsets" in u for u in updates)
            assert all("num_slots" not in u for u in updates)
            assert trainer.segment_name is None, "no ring was ever allocated"
        finally:
            trainer.shutdown()
    assert shared.name is None and shared.segment is None
    last = updates[-1]
    assert not procs.reachable(last["segment"], last["segment_fd"]), "closed to new workers"
    procs.bump(state)  # the tensors outlive the segment's descriptor: still usable memory
    assert all(torch.isfinite(t.float()).all() for t in state.values())


def test_a_replaced_tensor_sends_through_the_ring_with_a_warning(
    two_workers: list[Any], procs: Any
) -> None:
    """A tensor replaced since ``share_weights`` (``t.data = ...``) is no longer in shared
    memory: that round goes through the ring (bit-exact) and says why."""
    state = procs.make_state(22)
    for w in two_workers:
        w.setup(state)
    with share_weights(state):
        name = sorted(state)[-1]
        state[name].data = state[name].clone()  # moved out of the segment
        trainer, client = procs.trainer_for(two_workers, state, packed_buffer_size_bytes=4096)
        try:
            procs.bump(state)
            with pytest.warns(RuntimeWarning, match="no longer in the shared weights"):
                trainer.send_weights(weight_version="ring")
            for w in two_workers:
                procs.assert_bit_exact(w.dump(), state)
            assert all("num_slots" in u for u in _updates(client))
        finally:
            trainer.shutdown()


def _shared_round(two_workers: list[Any], procs: Any, state: Any) -> tuple[Any, Any, Any]:
    for w in two_workers:
        w.setup(state)
    shared = share_weights(state)
    trainer, client = procs.trainer_for(two_workers, state, packed_buffer_size_bytes=4096)
    trainer.send_weights(weight_version="good")
    return shared, trainer, _updates(client)[-1]


HOSTILE = {
    "replayed": (lambda u, n: {**u, "seq": u["seq"] - 1}, "stale, replayed"),
    "ahead": (lambda u, n: {**u, "seq": u["seq"] + 5}, "stale, replayed"),
    "past_the_end": (lambda u, n: {**u, "offsets": [*u["offsets"][:-1], n]}, "ends past the"),
    "misaligned": (lambda u, n: {**u, "offsets": [1, *u["offsets"][1:]]}, r"offsets\[0\]"),
    "too_few": (lambda u, n: {**u, "offsets": u["offsets"][:-1]}, "offsets: expected"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_announcement_is_refused_and_nothing_is_applied(
    two_workers: list[Any], procs: Any, kind: str
) -> None:
    """A replayed or future ``seq``, an offset past the shared weights, a misaligned one, a
    missing one: an error naming the field, the model untouched, no version published."""
    state = procs.make_state(23)
    shared, trainer, announce = _shared_round(two_workers, procs, state)
    try:
        forge, message = HOSTILE[kind]
        procs.refused_then_synced(
            two_workers, trainer, state, forge(announce, shared.nbytes), message
        )
    finally:
        trainer.shutdown()
        shared.close()


def test_a_round_the_trainer_abandoned_mid_copy_is_not_published(procs: Any) -> None:
    """The trainer stamps its header ``CANCELLED`` when it gives up on a round (its call
    timed out, and it may change its weights again): a worker that was still copying finds
    the header changed after its copy and fails the round instead of publishing it.
    In-process worker, so that the sink can stamp the header in the middle of the copy."""
    from wtcore import TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
    from wtcore.sink import ModuleSink
    from wtcore.testing import build_module
    from wtcore_ipc import IPCTrainerInitInfo
    from wtcore_kit.inproc import InProcessClient

    state = procs.make_state(24)
    shared = share_weights(state)
    assert shared.segment is not None
    segment = shared.segment

    class AbandoningSink(ModuleSink):
        def load_weights(self, weights: Any) -> None:
            super().load_weights(weights)
            segment.publish(0, segment_seq[0], CANCELLED)  # what a timed-out trainer does

    segment_seq = [0]
    module = build_module({k: torch.zeros_like(v) for k, v in state.items()})
    worker = WeightSyncWorker("ipc", AbandoningSink(module))
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, timeout_s=30),
        client=InProcessClient([worker], timeout_s=30),
        source=TensorSource(state),
    )
    try:
        segment_seq[0] = trainer._seq + 1
        with pytest.raises(ReceiverError, match="abandoned round seq=.* the loaded weights may"):
            trainer.send_weights(weight_version="abandoned")
        info = worker.weight_info()
        assert info["consistent"] is False and info["weight_version"] is None
    finally:
        trainer.shutdown()
        worker.shutdown()
        shared.close()


def test_a_killed_trainer_s_shared_weights_are_refused_and_released(
    two_workers: list[Any], procs: Any
) -> None:
    """The trainer (shared weights) is SIGKILLed after announcing its round, before the
    worker read it: the worker refuses weights whose owner is gone (no process holds the
    segment any more: the kernel freed it), and takes a new trainer's round bit-exact."""
    state = procs.make_state(7)
    worker = two_workers[0]
    worker.world_size = 1
    try:
        worker.setup(state)
        trainer = procs.TrainerProc("7", "4096", "1", "--shared")
        try:
            announce = procs.relay_until_update(trainer, worker)
            assert "offsets" in announce, "the trainer process sends from its shared weights"
            before = worker.dump()
            trainer.proc.kill()
            trainer.proc.wait(10)
            with pytest.raises(TransferError, match=r"trainer process that owned it"):
                worker.call("update_weights", announce, timeout_s=60)
            procs.assert_bit_exact(worker.dump(), before)
            assert not procs.our_segments([trainer.proc.pid]), "the kernel freed it"
            procs.bump(state)
            fresh, _ = procs.trainer_for([worker], state, packed_buffer_size_bytes=4096)
            try:
                fresh.send_weights(weight_version="fresh")
            finally:
                fresh.shutdown()
            procs.assert_bit_exact(worker.dump(), state)
        finally:
            trainer.close()
    finally:
        worker.world_size = 2


def test_share_weights_refuses_a_tensor_off_the_cpu() -> None:
    meta = torch.empty(3, device="meta")
    with pytest.raises(PayloadError, match="'w' is on meta"):
        share_weights({"w": meta})


def test_a_tied_module_keeps_its_ties() -> None:
    """Tied parameters (one tensor under two names) move once and stay one tensor."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    want = emb.weight.detach().clone()
    with share_weights(model) as shared:
        assert model["head"].weight is model["emb"].weight
        assert shared.offset_of(model["emb"].weight) == 0
        assert 160 <= shared.nbytes < 2 * 160, "one copy of the 160-byte table, not two"
        assert torch.equal(model["head"].weight, want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model["emb"].weight.data.mul_(2)  # in place: still in the segment
        assert shared.offset_of(model["head"].weight) == 0


def test_the_bench_measures_shared_weights(tmp_path: Any, capsys: Any) -> None:
    """``--engine-option shared_weights=true`` prepares the bench's model (not an init-info
    field): every round verified, one announcement per round, nothing packed; so does the
    default (the engine shares the model itself), and ``share_weights=false`` measures the
    ring."""
    from wtcore.cli import main

    small = ["bench", "--backend", "ipc", "--size", "256KiB", "--tensors", "8", "--rounds", "2"]
    small += ["--baselines", "none"]
    out = tmp_path / "r.json"
    assert main([*small, "--engine-option", "shared_weights=true", "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["verified"] is True
    assert all(r["num_buckets"] == 1 and r["phases"]["pack"] == 0 for r in run["rounds"])
    out_default = tmp_path / "default.json"
    assert main([*small, "--json", str(out_default)]) == 0
    default = json.loads(out_default.read_text())["runs"][0]
    assert default["verified"] is True
    assert all(r["num_buckets"] == 1 for r in default["rounds"])
    assert all(r["phases"]["pack"] == 0 for r in default["rounds"][1:]), "round 0 moves it"
    out_ring = tmp_path / "ring.json"
    ring_options = ["packed_buffer_size_bytes=65536", "share_weights=false"]
    ring_args = [a for o in ring_options for a in ("--engine-option", o)]
    assert main([*small, *ring_args, "--json", str(out_ring)]) == 0
    ring = json.loads(out_ring.read_text())["runs"][0]
    assert ring["verified"] is True and all(r["num_buckets"] > 1 for r in ring["rounds"])
    capsys.readouterr()
    assert main([*small, "--engine-option", "shared_weights=maybe"]) == 1
    assert "--engine-option shared_weights: expected true or false" in capsys.readouterr().err
