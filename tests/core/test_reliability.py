"""Transactional rounds, non-finite rejection, and end-to-end verification."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore import (
    InspectableClient,
    ModuleSink,
    PayloadError,
    ReceiverError,
    TensorSource,
    VerificationError,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore.testing import build_module, synthetic_state, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient


def _state(seed: int) -> dict[str, torch.Tensor]:
    return synthetic_state(64 << 10, 30, "float32", seed=seed)


def _setup(
    receiver_state: dict[str, torch.Tensor], **worker_kw: Any
) -> tuple[Any, WeightSyncWorker, torch.nn.Module]:
    model = build_module(zeros_like_state(receiver_state))
    worker = WeightSyncWorker("inline", ModuleSink(model), **worker_kw)
    engine = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=4096), client=InProcessClient(worker)
    )
    return engine, worker, model


@pytest.mark.parametrize("transactional", [False, True])
def test_failed_round_mixed_or_untouched(transactional: bool) -> None:
    good = _state(0)
    engine, worker, model = _setup(good, transactional=transactional)
    engine.send_weights(TensorSource(good), weight_version="v1")
    # The next round carries a tensor the receiver does not have, in its last bucket.
    bad = {**_state(1), "zz.unknown": torch.ones(3)}
    with pytest.raises(ReceiverError, match="unknown parameter name"):
        engine.send_weights(TensorSource(bad), weight_version="v2")
    info = worker.weight_info()
    assert info["weight_version"] == "v1" and info["rounds_failed"] == 1
    if transactional:
        assert info["consistent"] is True
        assert_state_equal(model, good)  # the old weights keep serving, untouched
    else:
        # Earlier buckets of the failed round were applied: the receiver says so.
        assert info["consistent"] is False
        first = next(iter(good))
        assert torch.equal(dict(model.named_parameters())[first], bad[first])
    engine.send_weights(TensorSource(_state(2)), weight_version="v3")  # recovers in place
    assert_state_equal(model, _state(2))
    assert worker.weight_info()["consistent"] is True


def test_transactional_commit_happens_only_at_finish() -> None:
    state = _state(0)
    model = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("inline", ModuleSink(model), transactional=True)
    calls: list[str] = []

    class Spy(InProcessClient):
        def finish_weight_update(self, weight_version: str | None = None) -> None:
            calls.append("finish")
            # Before finish, the model is still all zeros, but checksums show the staged round.
            assert all(not p.any() for p in model.parameters())
            assert worker.checksums() == digest_named(state.items())
            super().finish_weight_update(weight_version)

    engine = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=4096), client=Spy(worker)
    )
    engine.send_weights(TensorSource(state), weight_version="v1")
    assert calls == ["finish"]
    assert_state_equal(model, state)


@pytest.mark.parametrize("transactional", [False, True])
def test_reject_nonfinite(transactional: bool) -> None:
    good = _state(0)
    engine, worker, model = _setup(good, reject_nonfinite=True, transactional=transactional)
    engine.send_weights(TensorSource(good), weight_version="v1")
    bad = _state(1)
    name = next(iter(bad))
    bad[name][0, 0] = float("nan")
    with pytest.raises(
        ReceiverError,
        match=rf"rejected non-finite weights \(NaN or Inf\) in 1 tensor\(s\): '{name}'",
    ):
        engine.send_weights(TensorSource(bad), weight_version="v2")
    assert worker.weight_info()["weight_version"] == "v1"
    assert torch.equal(dict(model.named_parameters())[name], good[name])


class _CorruptingSink(ModuleSink):
    """Flips one value after loading: what a silent data-plane bug would look like."""

    def load_weights(self, weights: Any) -> None:
        batch = list(weights)
        super().load_weights(batch)
        name = batch[0][0]
        with torch.no_grad():
            self._targets[name].view(-1)[:1].add_(1)


def test_verify_passes_and_catches_corruption_before_finish() -> None:
    state = _state(0)
    engine, worker, model = _setup(state)
    engine.send_weights(TensorSource(state), weight_version="v1", verify=True)
    assert_state_equal(model, state)

    corrupt_model = build_module(zeros_like_state(state))
    bad_worker = WeightSyncWorker("inline", _CorruptingSink(corrupt_model))
    client = InProcessClient([worker, bad_worker])
    engine2 = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0), client=client
    )
    with pytest.raises(VerificationError) as exc:
        engine2.send_weights(TensorSource(state), weight_version="v2", verify=True)
    assert "receiver 1: 1 of 30 tensors differ" in str(exc.value)
    assert "receiver 0" not in str(exc.value)
    assert [w.weight_info()["weight_version"] for w in (worker, bad_worker)] == ["v1", None]
    # Re-init recovers: the open round is abandoned and the next one can start.
    engine3 = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0), client=InProcessClient(worker)
    )
    engine3.send_weights(TensorSource(state), weight_version="v3", verify=True)
    assert worker.weight_info()["weight_version"] == "v3"


def test_verify_needs_a_client_with_checksums() -> None:
    state = _state(0)

    class Bare:
        def __init__(self, inner: WeightSyncWorker) -> None:
            self.inner = inner

        def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
            self.inner.init_weight_transfer_engine(info)

        def start_weight_update(self) -> None:
            self.inner.start_weight_update()

        def update_weights(self, info: Any) -> None:
            self.inner.update_weights(info)

        def finish_weight_update(self, v: str | None = None) -> None:
            self.inner.finish_weight_update(v)

    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    engine = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0), client=Bare(worker)
    )
    with pytest.raises(PayloadError, match=r"verify=True needs an InspectableClient") as err:
        engine.send_weights(TensorSource(state), verify=True)
    assert isinstance(err.value, ValueError) and "Bare is not one" in str(err.value)
    assert engine.client.__class__ is Bare  # the wrapper never leaks
    # A bare worker is a WeightSyncClient but not an InspectableClient: wrapping it is the fix.
    assert not isinstance(worker, InspectableClient)
    engine = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0), client=InProcessClient(worker)
    )
    engine.send_weights(TensorSource(state), weight_version="v1", verify=True)
    assert engine.client.__class__ is InProcessClient  # the wrapper never leaks


@pytest.mark.parametrize("mixed_by", ["reset", "failed round"])
def test_a_partial_round_over_mixed_weights_publishes_but_is_not_consistent(mixed_by: str) -> None:
    """After a reset or a failed round, only rounds that wrote every tensor again make the
    weights consistent; a partial round publishes its version, reported inconsistent."""
    good = _state(0)
    engine, worker, model = _setup(good)
    engine.send_weights(TensorSource(good), weight_version="v1")
    names = list(good)
    if mixed_by == "reset":
        worker.reset_weights()
    else:
        bad = {**_state(1), "zz.unknown": torch.ones(3)}  # fails in its last bucket
        with pytest.raises(ReceiverError):
            engine.send_weights(TensorSource(bad), weight_version="bad")
    assert worker.weight_info()["consistent"] is False
    first_half = {n: good[n] for n in names[: len(names) // 2]}
    engine.send_weights(TensorSource(first_half), weight_version="v2")
    info = worker.weight_info()
    assert (info["weight_version"], info["consistent"]) == ("v2", False)
    # The rest, in a later round: every tensor has now been written since the weights mixed.
    engine.send_weights(
        TensorSource({n: good[n] for n in names[len(names) // 2 :]}), weight_version="v3"
    )
    assert (worker.weight_info()["weight_version"], worker.weight_info()["consistent"]) == (
        "v3",
        True,
    )
    assert_state_equal(model, good)
    # A partial round over consistent weights stays consistent (only what changed is sent).
    engine.send_weights(TensorSource(first_half), weight_version="v4")
    assert worker.weight_info()["consistent"] is True
