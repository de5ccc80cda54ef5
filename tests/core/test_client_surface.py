"""One client surface in process: both protocols, one return shape, timeouts as TimeoutError,
and one status for "init was not called" whatever the engine."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from wtcore import (
    InspectableClient,
    ProtocolStateError,
    ReceiverTimeoutError,
    TensorSource,
    WeightSyncClient,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore.errors import http_status
from wtcore.sink import ModuleSink
from wtcore.testing import build_module, synthetic_state, zeros_like_state
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient


def _state() -> dict[str, torch.Tensor]:
    return synthetic_state(total_bytes=32 << 10, num_tensors=6, seed=3)


class GatedSink(ModuleSink):
    """Holds ``load_weights`` until ``gate`` is set: a receiver stuck loading."""

    def __init__(self, module: torch.nn.Module, gate: threading.Event) -> None:
        super().__init__(module)
        self.gate = gate

    def load_weights(self, weights: Any) -> None:
        self.gate.wait(60)
        super().load_weights(weights)


def test_inproc_client_satisfies_both_protocols_with_one_shape() -> None:
    state = _state()
    workers = [
        WeightSyncWorker(
            "inline", ModuleSink(build_module(zeros_like_state(state))), rank=r, world_size=2
        )
        for r in range(2)
    ]
    with InProcessClient(workers) as client:
        assert isinstance(client, WeightSyncClient) and isinstance(client, InspectableClient)
        engine = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0), client=client
        )
        engine.send_weights(TensorSource(state), weight_version="v1")
        infos = client.weight_info()
        assert [(i["rank"], i["weight_version"], i["consistent"]) for i in infos] == [
            (0, "v1", True),
            (1, "v1", True),
        ]
        assert client.checksums() == [digest_named(state.items())] * 2
        assert client.get_world_size() == 2
        client.start_weight_update()
        client.abort_weight_update("operator said so")
        assert [i["state"] for i in client.weight_info()] == ["idle", "idle"]
        assert all("operator said so" in i["last_error"] for i in client.weight_info())
    # A bare worker is a WeightSyncClient, not an InspectableClient (its shapes are its own).
    assert isinstance(workers[0], WeightSyncClient)
    assert not isinstance(workers[0], InspectableClient)


def test_inproc_timeout_is_a_timeout_error() -> None:
    state = _state()
    gate = threading.Event()
    worker = WeightSyncWorker("inline", GatedSink(build_module(zeros_like_state(state)), gate))
    client = InProcessClient(worker, timeout_s=1.0)
    engine = WeightTransferTrainerFactory.trainer_init(InlineTrainerInitInfo(rank=0), client=client)
    try:
        with pytest.raises(TimeoutError) as err:
            engine.send_weights(TensorSource(state), weight_version="v1")
    finally:
        gate.set()
    assert isinstance(err.value, ReceiverTimeoutError)
    assert err.value.call == "update_weights"
    assert [f.receiver for f in err.value.failures] == ["worker[rank=0]"]
    assert "no answer within 1 s" in str(err.value)


@pytest.mark.parametrize("backend", ["inline", "nccl", "ipc"])
def test_init_not_called_is_409_everywhere(backend: str) -> None:
    """Same condition, same class and status: the worker's rules and the engine's own check."""
    if backend != "inline":
        pytest.importorskip(f"wtcore_{backend}")
    worker = WeightSyncWorker(backend, ModuleSink(build_module(zeros_like_state(_state()))))
    try:
        for call in (worker.start_weight_update, lambda: worker.update_weights({})):
            with pytest.raises(ProtocolStateError, match="not allowed in state 'uninitialized'"):
                call()
        # Inside a round an engine whose data plane is gone says the same (HTTP 409).
        with pytest.raises(ProtocolStateError) as err:
            worker.engine.start_weight_update()
            worker.engine.receive_weights(None)
        assert http_status(err.value) == 409
        assert client_status(worker) == 409
    finally:
        worker.shutdown()


def client_status(worker: WeightSyncWorker) -> int | None:
    """The status an in-process fan-out stamps on the same failure."""
    from wtcore.errors import ReceiverError

    with pytest.raises(ReceiverError) as err:
        InProcessClient(worker, timeout_s=10).start_weight_update()
    (failure,) = err.value.failures
    assert failure.error_type == "ProtocolStateError"
    return failure.status


def test_calls_of_lists_each_protocols_calls_in_order() -> None:
    from wtcore.client import InspectableClient, WeightSyncClient, calls_of

    four = (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    )
    assert calls_of(WeightSyncClient) == four
    inspect = ("weight_info", "checksums", "abort_weight_update", "get_world_size", "close")
    assert calls_of(InspectableClient) == four + inspect


def test_inspectable_sees_through_the_trainers_wrappers() -> None:
    """From Python 3.12 a protocol's ``isinstance`` ignores ``__getattr__``, so the round-id and
    verifying wrappers are asked for the client they wrap; a plain client stays itself."""
    from wtcore.client import inspectable
    from wtcore.rounds import RoundStampingClient

    state = _state()
    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    client = InProcessClient(worker, timeout_s=10)

    class Bare:  # a wrapper with no forwarding: what 3.12's isinstance sees of one
        def __init__(self, inner: object) -> None:
            self.inner = inner

    assert inspectable(client) is client
    assert inspectable(Bare(Bare(client))) is client
    assert inspectable(Bare(object())) is None and inspectable(None) is None
    wrapped = RoundStampingClient(client, 10)
    assert inspectable(wrapped) in (wrapped, client)  # 3.11 sees the forwarding, 3.12 not
    assert inspectable(wrapped).weight_info() == client.weight_info()  # type: ignore[union-attr]
