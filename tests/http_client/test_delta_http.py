"""Delta rounds over HTTP: real servers, the base checked with weight_info, a 409 refusal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from wtcore import TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.sink import ModuleSink
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.delta import assert_bits_equal, delta_chain
from wtcore_http_client import HTTPWeightSyncClient, ReceiverHTTPServer, ReceiverRoutes
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


@pytest.fixture
def fleet() -> Iterator[list[tuple[WeightSyncWorker, ModuleSink, ReceiverHTTPServer]]]:
    chain = delta_chain()
    out = []
    for rank in range(2):
        sink = ModuleSink(build_module(zeros_like_state(chain[0])))
        worker = WeightSyncWorker("inline", sink, rank=rank, world_size=2)
        out.append((worker, sink, ReceiverHTTPServer(ReceiverRoutes(worker)).start()))
    try:
        yield out
    finally:
        for worker, _, server in out:
            server.stop()
            worker.shutdown()


def _refused_then_full(trainer: Any, state: dict[str, Any], new: Any, version: str) -> None:
    """Step ``state`` to ``new``; the delta round is refused and sent full in the same call."""
    for n, t in state.items():
        t.copy_(new[n])
    stats = trainer.send_weights(weight_version=version)
    assert stats.delta is not None
    assert (stats.delta["mode"], stats.delta["why"]) == (
        "full",
        "refused by receivers (StaleBaseError)",
    )


def test_delta_chain_and_refusal_over_http(fleet: list[Any], monkeypatch: Any) -> None:
    chain = delta_chain()[:4]
    state = {n: t.clone() for n, t in chain[0].items()}
    info = InlineTrainerInitInfo(rank=0, delta=True, packed_buffer_size_bytes=1 << 20)
    with HTTPWeightSyncClient([s.url for _, _, s in fleet], timeout_s=30) as client:
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=TensorSource(state)
        )
        try:
            modes = []
            for step, new in enumerate(chain[:3]):
                for n, t in state.items():
                    t.copy_(new[n])
                stats = trainer.send_weights(weight_version=f"s{step}", verify=step == 2)
                assert stats.delta is not None
                modes.append(stats.delta["mode"])
                for _, sink, _ in fleet:
                    assert_bits_equal(dict(sink.named_tensors()), new)
            assert modes == ["full", "delta", "delta"]
            assert [i["delta"] for i in client.weight_info()] == [True, True]
            # The trainer's view is stale (it skips the check): both receivers answer 409
            # StaleBaseError, and the trainer sends a full round by itself.
            tracker = trainer.rounds.tracker
            tracker.version = "s1"
            monkeypatch.setattr(tracker, "why_full", lambda client: None)
            _refused_then_full(trainer, state, chain[3], "s3")
            for (worker, sink, _), info_ in zip(fleet, client.weight_info(), strict=True):
                assert_bits_equal(dict(sink.named_tensors()), chain[3])
                assert (info_["weight_version"], info_["consistent"]) == ("s3", True)
                assert worker.weight_info()["rounds_failed"] == 1  # the refused round
        finally:
            trainer.shutdown()


@pytest.mark.parametrize("other_delta", [True, False], ids=["delta-trainer", "plain-trainer"])
def test_another_trainers_round_of_the_same_version_name_is_no_base(
    fleet: list[Any], other_delta: bool
) -> None:
    # Trainer A's base is "v1". Trainer B (another job, or A's predecessor after a restart)
    # publishes its own "v1". A's next round must not patch B's weights: every receiver refuses
    # the patches (the lineage differs), and A sends its weights whole at once.
    chain = delta_chain()
    a_state = {n: t.clone() for n, t in chain[0].items()}
    b_state = {n: t.clone() for n, t in chain[-1].items()}  # every element differs from A's
    urls = [s.url for _, _, s in fleet]

    def trainer(state: dict[str, Any], delta: bool) -> Any:
        info = InlineTrainerInitInfo(rank=0, delta=delta, packed_buffer_size_bytes=1 << 20)
        client = HTTPWeightSyncClient(urls, timeout_s=30)
        return WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=TensorSource(state)
        )

    a, b = trainer(a_state, True), trainer(b_state, other_delta)
    try:
        assert a.send_weights(weight_version="v0").delta["mode"] == "full"
        for n, t in a_state.items():
            t.copy_(chain[1][n])
        assert a.send_weights(weight_version="v1").delta["mode"] == "delta"
        b.send_weights(weight_version="v1")
        for worker, sink, _ in fleet:
            assert_bits_equal(dict(sink.named_tensors()), chain[-1])
            assert worker.weight_info()["weight_version"] == "v1"
        _refused_then_full(a, a_state, chain[2], "v2")
        for worker, sink, _ in fleet:
            assert_bits_equal(dict(sink.named_tensors()), chain[2])
            info = worker.weight_info()
            assert (info["weight_version"], info["consistent"]) == ("v2", True)
        # Every receiver now holds A's weights, named as A's: the next round is a delta again.
        for n, t in a_state.items():
            t.copy_(chain[3][n])
        assert a.send_weights(weight_version="v3").delta["mode"] == "delta"
        for _, sink, _ in fleet:
            assert_bits_equal(dict(sink.named_tensors()), chain[3])
    finally:
        a.shutdown()
        b.shutdown()
