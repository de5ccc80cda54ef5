"""``require_round_id``: a receiver that serves only wtcore trainers refuses unowned rounds.

Round ids (``wtcore.rounds``) keep a second trainer's calls out of an owned round, but a
vLLM-style client that sends no id opens unowned rounds, and its init preempts anyone's. With
the option, every init, start, update or finish without an id is a 409 naming the option, and
nothing is applied; wtcore's clients send an id with every one of those calls, so their
rounds go through unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from wtcore import (
    PayloadError,
    ProtocolStateError,
    TensorSource,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore.rounds import ROUND_HEADER, new_round_id
from wtcore.sink import ModuleSink
from wtcore.testing.sources import (
    build_module,
    mixed_dtype_state,
    synthetic_state,
    zeros_like_state,
)
from wtcore_http_client import HTTPWeightSyncClient, ReceiverRoutes
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

SIZE, TENSORS = 64 << 10, 6
INIT = {"init_info": {"packed_buffer_size_bytes": 1 << 20}}
UNOWNED = [
    ("init_weight_transfer_engine", INIT),
    ("start_weight_update", None),
    ("update_weights", {"update_info": {"names": []}}),
    ("finish_weight_update", {"weight_version": "forged"}),
]


def _send(client: Any, state: dict[str, Any], version: str) -> None:
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=16 << 10)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    ) as trainer:
        trainer.send_weights(weight_version=version)


def test_wtcore_serve_refuses_every_unowned_call(start_server: Any) -> None:
    server = start_server("--require-round-id", "--size", str(SIZE), "--tensors", str(TENSORS))
    owner = {ROUND_HEADER: new_round_id()}

    def post(path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
        return requests.post(f"{server.url}/{path}", json=body, headers=headers, timeout=30)

    with HTTPWeightSyncClient(server.url, timeout_s=60) as client:
        before = client.checksums()
        for path, body in UNOWNED:
            r = post(path, body)
            assert r.status_code == 409, (path, r.text)
            assert "require_round_id" in r.json()["error"] and path in r.json()["error"]
            if path in ("init_weight_transfer_engine", "start_weight_update"):
                assert post(path, body, owner).status_code == 200  # with an id: taken
        info = client.weight_info()[0]  # the owner's round is open; nothing else happened
        assert (info["state"], info["weight_version"], info["rounds_ok"]) == ("updating", None, 0)
        assert post("abort_weight_update", {"reason": "test"}, owner).status_code == 200
        assert client.checksums() == before
        # A wtcore trainer's rounds go through as always.
        state = synthetic_state(SIZE, TENSORS, "float32", seed=7)
        _send(client, state, "v1")
        assert client.checksums() == [digest_named(state.items())]
        info = client.weight_info()[0]
        assert (info["weight_version"], info["consistent"]) == ("v1", True)


def test_the_worker_option_in_process() -> None:
    state = mixed_dtype_state(seed=2)
    sink = ModuleSink(build_module(zeros_like_state(state)))
    with pytest.raises(PayloadError, match="require_round_id: expected a bool"):
        WeightSyncWorker("inline", sink, require_round_id="yes")  # type: ignore[arg-type]
    worker = WeightSyncWorker("inline", sink, require_round_id=True)
    try:
        with pytest.raises(ProtocolStateError, match="init_weight_transfer_engine.*require_"):
            worker.init_weight_transfer_engine(INIT["init_info"])
        assert worker.weight_info()["state"] == "uninitialized"
        _send(InProcessClient([worker], timeout_s=30), state, "v1")
        assert worker.checksums() == digest_named(state.items())
        with pytest.raises(ProtocolStateError, match="start_weight_update.*require_round_id"):
            worker.start_weight_update()
        assert worker.weight_info()["state"] == "idle"
    finally:
        worker.shutdown()


def test_the_routes_option_over_a_worker_that_takes_unowned_rounds() -> None:
    state = mixed_dtype_state(seed=2)
    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    routes = ReceiverRoutes(worker, require_round_id=True)
    try:
        for path, body in UNOWNED:
            raw = b"" if body is None else json.dumps(body).encode()
            r = routes.handle("POST", f"/{path}", {}, raw)
            assert r.status == 409 and "require_round_id" in str(r.body), (path, r.body)
        assert worker.weight_info()["state"] == "uninitialized"
        owned = {ROUND_HEADER: new_round_id()}
        r = routes.handle("POST", "/init_weight_transfer_engine", owned, json.dumps(INIT).encode())
        assert r.status == 200, r.body
        with pytest.raises(PayloadError, match="require_round_id: expected a bool"):
            ReceiverRoutes(worker, require_round_id=1)  # type: ignore[arg-type]
    finally:
        worker.shutdown()
