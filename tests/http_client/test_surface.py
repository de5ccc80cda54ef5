"""The HTTP client on the one client surface: both protocols, the shared shapes, a stuck
receiver as a ``TimeoutError``, the abort route, and statuses from the core's one table.

The receiver is the real :class:`ReceiverHTTPServer` on 127.0.0.1, in this process, so its
sink can be held from the test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore import (
    InspectableClient,
    ReceiverError,
    ReceiverTimeoutError,
    TensorSource,
    WeightSyncClient,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore.sink import ModuleSink
from wtcore.testing import build_module, synthetic_state, zeros_like_state
from wtcore_http_client import HTTPWeightSyncClient, ReceiverHTTPServer, ReceiverRoutes
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = pytest.mark.processes

STATE = synthetic_state(total_bytes=32 << 10, num_tensors=6, seed=4)


class GatedSink(ModuleSink):
    """Holds ``load_weights`` until ``gate`` is set: a receiver stuck loading."""

    def __init__(self, module: torch.nn.Module, gate: threading.Event) -> None:
        super().__init__(module)
        self.gate = gate

    def load_weights(self, weights: Any) -> None:
        self.gate.wait(60)
        super().load_weights(weights)


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    g = threading.Event()
    g.set()
    yield g
    g.set()


@pytest.fixture
def servers(gate: threading.Event) -> Iterator[list[tuple[WeightSyncWorker, ReceiverHTTPServer]]]:
    out = []
    for rank in range(2):
        sink = GatedSink(build_module(zeros_like_state(STATE)), gate)
        worker = WeightSyncWorker("inline", sink, rank=rank, world_size=2)
        out.append((worker, ReceiverHTTPServer(ReceiverRoutes(worker)).start()))
    try:
        yield out
    finally:
        gate.set()
        for worker, server in out:
            server.stop()
            worker.shutdown()


def test_both_protocols_and_the_shared_shapes(servers: list[Any]) -> None:
    urls = [s.url for _, s in servers]
    with HTTPWeightSyncClient(urls, timeout_s=30) as client:
        assert isinstance(client, WeightSyncClient) and isinstance(client, InspectableClient)
        engine = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0), client=client
        )
        engine.send_weights(TensorSource(STATE), weight_version="h1", verify=True)
        infos = client.weight_info()
        assert [(i["rank"], i["weight_version"]) for i in infos] == [(0, "h1"), (1, "h1")]
        assert client.checksums() == [digest_named(STATE.items())] * 2
        assert client.get_world_size() == 2
        # abort over wtcore's own route ends an open round without publishing
        client.start_weight_update()
        client.abort_weight_update("operator said so")
        infos = client.weight_info()
        assert [i["state"] for i in infos] == ["idle", "idle"]
        assert all("operator said so" in i["last_error"] for i in infos)
        assert [i["weight_version"] for i in infos] == ["h1", "h1"]


def test_a_stuck_receiver_is_a_timeout_error(servers: list[Any], gate: threading.Event) -> None:
    gate.clear()
    urls = [s.url for _, s in servers]
    with HTTPWeightSyncClient(urls, timeout_s=1.0) as client:
        engine = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0), client=client
        )
        with pytest.raises(TimeoutError) as err:
            engine.send_weights(TensorSource(STATE), weight_version="h2")
    assert isinstance(err.value, ReceiverTimeoutError) and isinstance(err.value, ReceiverError)
    assert err.value.call == "update_weights"
    assert [f.receiver for f in err.value.failures] == urls


def test_init_not_called_is_409_with_the_core_class(servers: list[Any]) -> None:
    url = servers[0][1].url
    with HTTPWeightSyncClient(url, timeout_s=10) as client, pytest.raises(ReceiverError) as err:
        client.start_weight_update()
    (failure,) = err.value.failures
    assert (failure.status, failure.error_type) == (409, "ProtocolStateError")
    assert "not allowed in state 'uninitialized'" in failure.message
