"""Staged rounds in process: a fleet stages beside its live weights, prepares, then commits.

Real workers and the inline engine; the only stand-ins are clients that watch (or fail) one
receiver at the prepare, the one moment the fleet commit exists for.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore import (
    ModuleSink,
    PayloadError,
    ProtocolStateError,
    ReceiverError,
    TensorSource,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.rounds import PREPARE_KEY
from wtcore.testing import build_module, synthetic_state, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient


def _state(seed: int) -> dict[str, torch.Tensor]:
    return synthetic_state(64 << 10, 20, "float32", seed=seed)


def _fleet(n: int, **worker_kw: Any) -> tuple[list[WeightSyncWorker], list[torch.nn.Module]]:
    models = [build_module(zeros_like_state(_state(0))) for _ in range(n)]
    workers = [
        WeightSyncWorker("inline", ModuleSink(m), rank=i, world_size=n, **worker_kw)
        for i, m in enumerate(models)
    ]
    return workers, models


def _trainer(client: Any, *, staged: bool = True) -> Any:
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=8 << 10, staged=staged)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


class _AtPrepare(InProcessClient):
    """Runs ``before(workers)`` when the round's prepare goes out, then forwards it."""

    def __init__(self, workers: list[WeightSyncWorker], before: Any) -> None:
        super().__init__(workers)
        self.before = before
        self.prepares = 0

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, dict) and PREPARE_KEY in update_info:
            self.prepares += 1
            self.before(self.workers)
        super().update_weights(update_info)


def test_the_fleet_serves_the_old_weights_until_every_receiver_prepared() -> None:
    workers, models = _fleet(2, transactional=True)
    v1, v2 = _state(1), _state(2)
    seen: list[tuple[Any, ...]] = []

    def still_old(ws: list[WeightSyncWorker]) -> None:
        # Every byte of v2 has landed in staging; the live weights are still v1, published.
        for w, m in zip(ws, models, strict=True):
            info = w.weight_info()
            seen.append((info["weight_version"], info["consistent"], info["state"]))
            assert_state_equal(m, v1)

    trainer = _trainer(InProcessClient(workers))
    trainer.send_weights(TensorSource(v1), weight_version="v1")
    trainer.client = client = _AtPrepare(workers, still_old)
    stats = trainer.send_weights(TensorSource(v2), weight_version="v2")
    assert client.prepares == 1
    assert seen == [("v1", True, "updating")] * 2
    for w, m in zip(workers, models, strict=True):
        assert_state_equal(m, v2)
        info = w.weight_info()
        assert (info["weight_version"], info["consistent"]) == ("v2", True)
        # Paused for the commit only; the round's transfer was staged beside the live weights.
        assert info["paused_s"] == info["commit_s"] and info["staged_s"] > 0
    assert stats.receiver_times is not None and len(stats.receiver_times) == 2
    assert stats.receiver_times[0]["paused_s"] == workers[0].weight_info()["paused_s"]


def test_a_classic_round_reports_paused_from_its_first_byte() -> None:
    workers, _ = _fleet(1)
    trainer = _trainer(InProcessClient(workers), staged=False)
    stats = trainer.send_weights(TensorSource(_state(1)), weight_version="v1")
    info = workers[0].weight_info()
    assert info["staged_s"] is None and info["paused_s"] >= info["commit_s"] > 0
    assert stats.receiver_times == [{k: info[k] for k in ("staged_s", "commit_s", "paused_s")}]


def test_a_receiver_that_fails_at_prepare_aborts_the_round_everywhere() -> None:
    workers, models = _fleet(2, transactional=True)
    v1 = _state(1)

    def lose_the_round(ws: list[WeightSyncWorker]) -> None:
        # The second receiver is re-initialized (a restart, a second trainer): its staged
        # round is gone, while the first receiver holds its complete round.
        ws[1].init_weight_transfer_engine(trainer.worker_init_info())

    trainer = _trainer(InProcessClient(workers))
    trainer.send_weights(TensorSource(v1), weight_version="v1")
    trainer.client = _AtPrepare(workers, lose_the_round)
    with pytest.raises(ReceiverError) as err:
        trainer.send_weights(TensorSource(_state(2)), weight_version="v2")
    assert err.value.call == "update_weights"
    assert [f.receiver for f in err.value.failures] == ["worker[rank=1]"]
    assert "no longer open" in err.value.failures[0].message
    for w, m in zip(workers, models, strict=True):
        info = w.weight_info()
        assert (info["weight_version"], info["consistent"], info["state"]) == ("v1", True, "idle")
        assert_state_equal(m, v1)
    # The next round commits on both.
    trainer.client = InProcessClient(workers)
    trainer.send_weights(TensorSource(_state(3)), weight_version="v3")
    for w, m in zip(workers, models, strict=True):
        assert w.weight_info()["weight_version"] == "v3"
        assert_state_equal(m, _state(3))


def test_a_receiver_that_writes_live_refuses_a_staged_round_before_anything_lands() -> None:
    staging, _ = _fleet(1, transactional=True)
    live, live_models = _fleet(1)
    workers = [*staging, *live]
    trainer = _trainer(InProcessClient(workers), staged=False)
    trainer.send_weights(TensorSource(_state(1)), weight_version="v1")
    trainer.init_info.staged = True
    with pytest.raises(ReceiverError, match="transactional=True") as err:
        trainer.send_weights(TensorSource(_state(2)), weight_version="v2")
    assert len(err.value.failures) == 1 and "wtcore_staged" in err.value.failures[0].message
    for w in workers:
        info = w.weight_info()
        assert (info["weight_version"], info["consistent"]) == ("v1", True)
    assert_state_equal(live_models[0], _state(1))


def test_prepare_is_the_rounds_last_word() -> None:
    [worker], [model] = _fleet(1, transactional=True)
    trainer = _trainer(worker)
    trainer.send_weights(TensorSource(_state(1)), weight_version="v1")
    worker.start_weight_update()
    with pytest.raises(ProtocolStateError, match="applied no update_weights"):
        worker.update_weights({PREPARE_KEY: True})
    worker.abort_weight_update()
    updates: list[Any] = []

    class Replaying(InProcessClient):
        def update_weights(self, update_info: Any) -> None:
            if PREPARE_KEY not in update_info:
                updates.append(update_info)
            super().update_weights(update_info)
            if PREPARE_KEY in update_info:
                # After the prepare, no tensor may join the round: only its finish may follow.
                with pytest.raises(ProtocolStateError, match="was prepared"):
                    worker.update_weights(updates[0])

    trainer.client = Replaying([worker])
    trainer.send_weights(TensorSource(_state(2)), weight_version="v2")
    assert_state_equal(model, _state(2))
    assert worker.weight_info()["weight_version"] == "v2"


def test_prepare_needs_a_staging_receiver() -> None:
    [worker], _ = _fleet(1)
    trainer = _trainer(worker, staged=False)
    trainer.send_weights(TensorSource(_state(1)), weight_version="v1")
    worker.start_weight_update()
    with pytest.raises(PayloadError, match="only a receiver that stages"):
        worker.update_weights({PREPARE_KEY: True})


def test_staged_must_be_a_bool() -> None:
    with pytest.raises(PayloadError, match="staged: expected a bool"):
        InlineTrainerInitInfo(rank=0, staged="yes")  # type: ignore[arg-type]


def test_staged_delta_rounds_stage_only_what_changed() -> None:
    pytest.importorskip("wtcore_delta")
    workers, models = _fleet(2, transactional=True)
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=8 << 10, staged=True, delta=True)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=InProcessClient(workers))
    state = _state(1)
    modes = []
    for step in range(3):
        name = sorted(state)[step]
        state[name] = state[name] + 1  # one tensor changes a step
        stats = trainer.send_weights(TensorSource(state), weight_version=f"s{step}")
        assert stats.delta is not None
        modes.append(stats.delta["mode"])
        for w, m in zip(workers, models, strict=True):
            assert_state_equal(m, state)
            assert w.weight_info()["staged_s"] is not None
    assert modes[1:] == ["delta", "delta"]
