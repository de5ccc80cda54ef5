"""docs/http.md's "mounted into your own app" example, run as written under uvicorn.

The code block is executed with a model and an engine stub defined first, served by a real
uvicorn server on a free loopback port, and driven by the real ``HTTPWeightSyncClient`` and the
``nccl`` trainer engine (gloo on CPU): the mount must behave like ``wtcore serve``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.testing import build_module, free_port, mixed_dtype_state, zeros_like_state

pytestmark = pytest.mark.processes

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

DOC = Path(__file__).resolve().parents[2] / "docs" / "http.md"


def _mount_block() -> str:
    section = DOC.read_text().split("### 2. Mounted into your own app", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


class _EngineStub:
    def __init__(self) -> None:
        self.paused: list[str] = []

    def pause(self, mode: str) -> None:
        self.paused.append(mode)

    def resume(self) -> None:
        self.paused.append("resumed")


@pytest.fixture
def mounted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.delenv("WTCORE_API_KEY", raising=False)
    state = mixed_dtype_state(seed=3)
    namespace: dict[str, Any] = {
        "model": build_module(zeros_like_state(state)),
        "my_engine": _EngineStub(),
    }
    exec(compile(_mount_block(), str(DOC), "exec"), namespace)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(namespace["app"], host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield {**namespace, "url": f"http://127.0.0.1:{port}", "state": state}
    finally:
        server.should_exit = True
        thread.join(15)
        namespace["worker"].shutdown()


@pytest.mark.timeout(120)
def test_mounted_routes_receive_an_nccl_round(mounted: dict[str, Any]) -> None:
    import requests

    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_nccl import NCCLTrainerInitInfo

    url, state = mounted["url"], mounted["state"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    # Out of order and malformed: the same statuses as wtcore serve, nothing applied.
    r = requests.post(f"{url}/start_weight_update", timeout=10)
    assert r.status_code == 409 and "init_weight_transfer_engine" in r.json()["error"]
    r = requests.post(f"{url}/init_weight_transfer_engine", data=b"{not json", timeout=10)
    assert r.status_code == 400

    client = HTTPWeightSyncClient(url, timeout_s=60)
    info = NCCLTrainerInitInfo("127.0.0.1", free_port(), world_size=2, timeout_s=30, rank=0)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    ) as trainer:
        client.pause(mode="keep")
        trainer.send_weights(weight_version="mounted-1")
        client.resume()
    assert client.checksums() == [digest_named(state.items())]
    assert [i["weight_version"] for i in client.weight_info()] == ["mounted-1"]
    held = dict(mounted["model"].named_parameters())
    assert all(torch.equal(held[n], t) for n, t in state.items())
    assert mounted["my_engine"].paused == ["keep", "resumed"]
    client.close()
