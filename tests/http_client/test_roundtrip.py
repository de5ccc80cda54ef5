"""Full rounds through two real receiver processes and one fan-out HTTP client."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.buckets import max_bucket_nbytes, pack_source, plan_buckets
from wtcore.config import trainer_from_config
from wtcore.digest import digest_named
from wtcore.meta import metas_to_wire
from wtcore.testing.sources import mixed_dtype_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_http_client.safetensors import save_safetensors
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


def _state(seed: int) -> dict[str, torch.Tensor]:
    return mixed_dtype_state(seed)


def local_payload(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One ``inline`` update holding all of ``state`` (built with the core's bucket rule)."""
    source = TensorSource(state)
    metas = source.metadata()
    buckets = plan_buckets(metas, 1 << 20)
    assert len(buckets) == 1
    staging = torch.empty(max_bucket_nbytes(buckets), dtype=torch.uint8)
    ((bucket, filled),) = list(pack_source(source, metas, buckets, lambda _b: staging))
    data = base64.b64encode(filled.numpy().tobytes()).decode("ascii")
    return {**metas_to_wire(bucket.metas), "data": data}


@pytest.fixture(scope="module")
def servers(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Two workers (ranks 0 and 1 of 2) hosting the same safetensors checkpoint."""
    path = Path(tmp_path_factory.mktemp("ckpt")) / "model.safetensors"
    save_safetensors(_state(0), path)
    common = ("--backend", "inline", "--world-size", "2", "--safetensors", str(path))
    return [start_server("--rank", str(r), *common) for r in range(2)]


@pytest.fixture()
def client(servers: list[Any]) -> Any:
    with HTTPWeightSyncClient([s.url for s in servers], timeout_s=60) as c:
        yield c


def test_servers_start_from_the_checkpoint(client: HTTPWeightSyncClient) -> None:
    want = digest_named(_state(0).items())
    assert client.checksums() == [want, want]
    assert client.get_world_size() == 2
    assert [i["rank"] for i in client.weight_info()] == [0, 1]


def test_rounds_through_the_local_engine(client: HTTPWeightSyncClient) -> None:
    source_state = _state(1)
    trainer = WeightTransferTrainerFactory.trainer_init(
        # a small buffer: several buckets, so several update_weights per round
        InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=4096),
        client=client,
        source=TensorSource(source_state),
    )
    with trainer:
        for step in range(1, 4):
            state = _state(step)
            for name, t in source_state.items():  # train: change the weights in place
                t.copy_(state[name])
            stats = trainer.send_weights(weight_version=f"step-{step}")
            assert stats.num_buckets > 1
            want = digest_named(state.items())
            assert client.checksums() == [want, want], f"round {step}: weights differ"
            for info in client.weight_info():
                assert info["weight_version"] == f"step-{step}"
                assert info["consistent"] is True
                assert info["state"] == "idle"


def test_per_rank_update_list_reaches_each_rank(client: HTTPWeightSyncClient) -> None:
    """``{"update_info": [rank0, rank1]}``: each worker loads its own entry."""
    a, b = _state(11), _state(12)
    client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 20})
    client.start_weight_update()
    client.update_weights([local_payload(a), local_payload(b)])
    client.finish_weight_update("per-rank")
    assert client.checksums() == [digest_named(a.items()), digest_named(b.items())]
    assert [i["weight_version"] for i in client.weight_info()] == ["per-rank", "per-rank"]


def test_trainer_from_config_builds_the_http_client(servers: list[Any]) -> None:
    state = _state(21)
    trainer = trainer_from_config(
        {
            "backend": "inline",
            "packed_buffer_size_bytes": 8192,
            "client": {"name": "http", "base_urls": [s.url for s in servers], "timeout_s": 60},
        },
        source=TensorSource(state),
    )
    with trainer:
        trainer.send_weights(weight_version="from-config")
    assert isinstance(trainer.client, HTTPWeightSyncClient)
    want = digest_named(state.items())
    assert trainer.client.checksums() == [want, want]
    trainer.client.close()


def test_pause_and_resume_fan_out(client: HTTPWeightSyncClient) -> None:
    client.pause(mode="keep")
    assert client.is_paused() == [True, True]
    assert all(i["paused"] for i in client.weight_info())
    client.resume()
    assert client.is_paused() == [False, False]
    with pytest.raises(ValueError, match="mode: expected one of abort, wait, keep"):
        client.pause(mode="later")


def test_commit_pause_pauses_around_the_finish_only(servers: list[Any]) -> None:
    urls = [s.url for s in servers]
    calls: list[tuple[str, tuple[Any, ...]]] = []

    class Recording(HTTPWeightSyncClient):
        def _call(self, url: str, call: str, *args: Any, round_id: str | None = None) -> Any:
            if url == urls[0]:
                calls.append((call, args))
            return super()._call(url, call, *args, round_id=round_id)

    state = _state(31)
    with (
        Recording(urls, timeout_s=60, commit_pause="wait") as c,
        WeightTransferTrainerFactory.trainer_init(InlineTrainerInitInfo(rank=0), client=c) as t,
    ):
        t.send_weights(TensorSource(state), weight_version="paused-commit")
        assert c.checksums() == [digest_named(state.items())] * 2
        assert c.is_paused() == [False, False]
    round_calls = [(n, a) for n, a in calls if n not in ("weight_info", "checksums", "is_paused")]
    assert [n for n, _ in round_calls][-4:] == [
        "update_weights",
        "pause",
        "finish_weight_update",
        "resume",
    ]
    assert round_calls[-3][1] == ({"mode": "wait"},)
    with pytest.raises(ValueError, match="commit_pause: expected one of abort, wait, keep"):
        HTTPWeightSyncClient(urls, commit_pause="later")
