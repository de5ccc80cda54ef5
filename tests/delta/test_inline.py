"""The delta-round suite on the built-in ``inline`` engine pair."""

from __future__ import annotations

import pytest

from wtcore.testing.delta import DeltaContractSuite
from wtcore_kit.inline import InlineTrainerInitInfo


class TestInlineDelta(DeltaContractSuite):
    backend = "inline"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> InlineTrainerInitInfo:
        return InlineTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, rank=0)


def test_dense_tensor_refreshes_its_base_ever_less_often() -> None:
    # A tensor that changes entirely every round is sent whole; its base copy is refreshed
    # after 0, 1, 3 rounds... (not every round), and what the trainer would resend (the base
    # source) is always the new weights, bit for bit.
    import torch

    from wtcore.source import TensorSource
    from wtcore.testing.delta import assert_bits_equal
    from wtcore_delta.codec import bits
    from wtcore_delta.trainer import DeltaReport, DeltaTracker

    t = torch.randn(100_000).to(torch.bfloat16)
    tracker = DeltaTracker()
    list(tracker.refreshing(TensorSource({"w": t})))
    tracker.commit("v0")
    stored = []
    for r in range(10):
        b = bits(t)
        b.copy_(b ^ 1)
        report = DeltaReport()
        tracker.encode(TensorSource({"w": t}), report)
        assert report.tensors["full"] == 1
        assert_bits_equal(dict(tracker.base_source()), {"w": t})
        tracker.commit(f"v{r + 1}")
        stored.append(tracker._base["w"] is not None)
    assert stored == [False, True, False, False, True, False, False, False, False, True]


def test_a_refused_delta_round_leaves_the_receiver_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The header is refused before anything is applied: the receiver keeps its version and
    # stays consistent (without the safety net's full round, the error reaches the caller).
    import torch

    from wtcore.errors import ReceiverError
    from wtcore.factory import WeightTransferTrainerFactory
    from wtcore.sink import ModuleSink
    from wtcore.source import TensorSource
    from wtcore.testing.delta import assert_bits_equal
    from wtcore.testing.sources import build_module, zeros_like_state
    from wtcore.worker import WeightSyncWorker
    from wtcore_kit.inproc import InProcessClient

    state = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    sink = ModuleSink(build_module(zeros_like_state(state)))
    worker = WeightSyncWorker("inline", sink)
    info = InlineTrainerInitInfo(rank=0, delta=True)
    client = InProcessClient([worker], timeout_s=30)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    ) as trainer:
        trainer.send_weights(weight_version="v1")
        sent = {"w": state["w"].clone()}
        state["w"][0, :3] += 1
        tracker = trainer.rounds.tracker
        tracker.version = "not-v1"  # as if the trainer's view were stale
        monkeypatch.setattr(tracker, "why_full", lambda client: None)
        monkeypatch.setattr("wtcore_delta.trainer._refused", lambda e: False)
        with pytest.raises(ReceiverError, match="StaleBaseError") as err:
            trainer.send_weights(weight_version="v2")
        assert "[409]" in str(err.value) and "'not-v1'" in str(err.value)
    info_after = worker.weight_info()
    assert (info_after["weight_version"], info_after["consistent"]) == ("v1", True)
    assert info_after["rounds_failed"] == 1
    assert_bits_equal(dict(sink.named_tensors()), sent)
    worker.shutdown()


def test_bench_delta_runs_and_counts_bytes() -> None:
    from wtcore_bench.delta import DeltaBenchOptions, run_delta_bench

    record = run_delta_bench(DeltaBenchOptions(steps=1, dense_rounds=2, width=32))
    assert record["ok"]
    rounds = record["rounds"]
    assert [r["mode"] for r in rounds] == ["full", "delta", "delta", "delta"]
    assert rounds[1]["delta_bytes"] * 3 < rounds[1]["full_bytes"]
    assert rounds[2]["changed_fraction"] == 1.0 and rounds[2]["tensors"]["patch"] == 0


def test_rounds_without_a_version_are_full_and_keep_no_base() -> None:
    import torch

    from wtcore.factory import WeightTransferTrainerFactory
    from wtcore.sink import ModuleSink
    from wtcore.source import TensorSource
    from wtcore.testing.sources import build_module, zeros_like_state
    from wtcore.worker import WeightSyncWorker
    from wtcore_kit.inproc import InProcessClient

    state = {"w": torch.randn(300, 300).to(torch.bfloat16)}
    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    client = InProcessClient([worker], timeout_s=30)
    info = InlineTrainerInitInfo(rank=0, delta=True)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    ) as trainer:
        for _ in range(2):
            stats = trainer.send_weights()
            assert stats.delta is not None and stats.delta["mode"] == "full"
            assert "no weight_version" in stats.delta["why"]
            assert trainer.rounds.tracker._base == {}
        stats = trainer.send_weights(weight_version="v1")
        assert stats.delta is not None and stats.delta["base_copies"] == 1
        state["w"][0, 0] += 1
        stats = trainer.send_weights(weight_version="v2")
        assert stats.delta is not None and stats.delta["mode"] == "delta"
        assert stats.num_bytes < 200
    worker.shutdown()
