"""vLLM's newer routes on wtcore's receivers: ``/update_weight_version`` and
``/get_world_size?include_dp=``, with vLLM's request and response shapes, against a real
``wtcore serve`` process."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from wtcore import PayloadError, ProtocolStateError, TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

SIZE, TENSORS = 32 << 10, 4


def test_update_weight_version_and_include_dp(start_server: Any) -> None:
    server = start_server("--size", str(SIZE), "--tensors", str(TENSORS), "--world-size", "1")
    url = server.url
    r = requests.post(f"{url}/update_weight_version", json={"new_version": "early"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True, "new_version": "early"}
    for flag in ("true", "false", "1", "0"):
        r = requests.get(f"{url}/get_world_size", params={"include_dp": flag}, timeout=30)
        assert r.status_code == 200 and r.json() == {"world_size": 1}
    r = requests.get(f"{url}/get_world_size", params={"include_dp": "maybe"}, timeout=30)
    assert r.status_code == 400 and "include_dp" in r.json()["error"]
    r = requests.post(f"{url}/update_weight_version", json={"new_version": 7}, timeout=30)
    assert r.status_code == 400 and "new_version" in r.json()["error"]
    with HTTPWeightSyncClient(url, timeout_s=60) as client:
        assert client.get_world_size(include_dp=False) == client.get_world_size() == 1
        state = synthetic_state(SIZE, TENSORS, "float32", seed=9)
        info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=16 << 10)
        with WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=TensorSource(state)
        ) as trainer:
            trainer.send_weights(weight_version="step-1")
        client.update_weight_version("step-1-eval")  # a label only: the weights stay
        got = client.weight_info()[0]
        assert (got["weight_version"], got["consistent"]) == ("step-1-eval", True)
        assert client.checksums() == [digest_named(state.items())]
        # Mid-round it is refused: the open round's finish names the version.
        client.start_weight_update()
        r = requests.post(f"{url}/update_weight_version", json={"new_version": "x"}, timeout=30)
        assert r.status_code == 409 and "between rounds" in r.json()["error"]
        client.abort_weight_update("test")
        assert client.weight_info()[0]["weight_version"] == "step-1-eval"


def test_the_worker_refuses_a_rename_mid_round() -> None:
    from wtcore.sink import ModuleSink
    from wtcore.testing.sources import build_module, zeros_like_state
    from wtcore.worker import WeightSyncWorker
    from wtcore_kit.inproc import InProcessClient

    state = synthetic_state(SIZE, TENSORS, "float32", seed=1)
    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    try:
        client = InProcessClient([worker], timeout_s=30)
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 20})
        client.update_weight_version("v0")
        assert worker.weight_info()["weight_version"] == "v0"
        client.start_weight_update()
        with pytest.raises(ProtocolStateError, match="update_weight_version.*between rounds"):
            worker.update_weight_version("v1")
        client.abort_weight_update("test")
        with pytest.raises(PayloadError, match="over the limit"):
            worker.update_weight_version("v" * 300)
        assert worker.weight_info()["weight_version"] == "v0"
    finally:
        worker.shutdown()
