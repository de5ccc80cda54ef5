"""Server behaviour that needs a controllable engine: long calls and engine failures.

The server is the real :class:`ReceiverHTTPServer` on 127.0.0.1, run in this process so that a
test engine (registered at runtime) can be told to block or fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from wtcore import ENGINES, ReceiverError, WeightSyncWorker
from wtcore.digest import digest_named
from wtcore.sink import ModuleSink
from wtcore.testing.sources import build_module, mixed_dtype_state
from wtcore_http_client import HTTPWeightSyncClient, ReceiverHTTPServer, ReceiverRoutes
from wtcore_http_client.server import check_bind, is_loopback
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.inline import InlineUpdateInfo, InlineWorkerEngine

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

NAME = "http-client-test-gate"


class GateEngine(InlineWorkerEngine):
    """The ``inline`` engine, except that it can be made to block or to fail in receive."""

    release = threading.Event()
    block = False
    fail: str | None = None

    def receive_weights(self, update_info: InlineUpdateInfo) -> None:
        if GateEngine.block and not GateEngine.release.wait(30):
            raise TimeoutError("the test never released the gate")
        if GateEngine.fail is not None:
            raise RuntimeError(GateEngine.fail)
        super().receive_weights(update_info)


@pytest.fixture()
def served() -> Iterator[tuple[WeightSyncWorker, ReceiverHTTPServer]]:
    ENGINES.register(NAME, GateEngine, replace=True)
    GateEngine.release.clear()
    GateEngine.block, GateEngine.fail = False, None
    worker = WeightSyncWorker(NAME, ModuleSink(build_module(mixed_dtype_state(0))))
    server = ReceiverHTTPServer(ReceiverRoutes(worker)).start()
    try:
        yield worker, server
    finally:
        GateEngine.release.set()
        server.stop()
        worker.shutdown()
        ENGINES.unregister(NAME)


EMPTY = {"names": [], "dtype_names": [], "shapes": [], "data": ""}


def test_a_long_update_does_not_block_health_or_info(served: Any) -> None:
    worker, server = served
    client = HTTPWeightSyncClient(server.url, timeout_s=30)
    client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1024})
    client.start_weight_update()
    GateEngine.block = True
    update = BackgroundCall(client.update_weights, EMPTY, name="update")
    deadline = time.monotonic() + 20
    while worker.weight_info()["busy"] != "update_weights":
        assert time.monotonic() < deadline, "the update never started"
        time.sleep(0.01)
    # The update is blocked inside the engine. These must answer anyway (a short timeout
    # turns "blocked behind the update" into a failure rather than a slow pass).
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    info = requests.get(server.url + "/weight_info", timeout=5).json()
    assert info["busy"] == "update_weights" and info["state"] == "updating"
    r = requests.post(server.url + "/start_weight_update", timeout=5)
    assert r.status_code == 409 and "update_weights is still running" in r.json()["error"]
    assert not update.done()
    GateEngine.release.set()
    update.result(20)
    client.finish_weight_update("after-the-wait")
    assert client.weight_info()[0]["weight_version"] == "after-the-wait"
    client.close()


def test_engine_failure_is_a_500_with_its_text(served: Any) -> None:
    worker, server = served
    before = digest_named(worker.sink.named_tensors())
    client = HTTPWeightSyncClient(server.url, timeout_s=30)
    client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1024})
    client.start_weight_update()
    GateEngine.fail = "disk on fire"
    with pytest.raises(ReceiverError) as err:
        client.update_weights(EMPTY)
    (failure,) = err.value.failures
    assert failure.status == 500 and "RuntimeError: disk on fire" in failure.message
    info = client.weight_info()[0]
    assert info["consistent"] is False and "disk on fire" in info["last_error"]
    assert info["weight_version"] is None
    assert client.checksums() == [before]
    client.close()


def test_refuses_a_public_bind_without_a_key() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without an API key"):
        check_bind("0.0.0.0", False)
    check_bind("0.0.0.0", True)
    check_bind("127.0.0.1", False)
    worker = WeightSyncWorker("inline", ModuleSink(build_module(mixed_dtype_state(0))))
    with pytest.raises(ValueError, match="refusing to bind"):
        ReceiverHTTPServer(ReceiverRoutes(worker), host="0.0.0.0")
    worker.shutdown()
