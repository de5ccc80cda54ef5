"""The mooncake engine across processes: two ``wtcore serve --backend mooncake`` receivers pull
a round from this process's trainer over HTTP, each with a transfer engine of its own."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore_bench.serve import launch_serve
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.synthetic import synthetic_state
from wtcore_mooncake import MooncakeTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SIZE, TENSORS = 8 << 20, 40


def test_two_serve_processes_pull_every_byte_of_two_rounds(tmp_path: Path) -> None:
    model = ["--size", str(SIZE), "--tensors", str(TENSORS), "--seed", "0"]
    with contextlib.ExitStack() as stack:
        servers = []
        for _ in range(2):
            server = launch_serve(["--backend", "mooncake", *model], workdir=tmp_path)
            stack.callback(server.stop)
            servers.append(server)
        client = stack.enter_context(HTTPWeightSyncClient([s.url for s in servers], timeout_s=120))
        info = MooncakeTrainerInitInfo(packed_buffer_size_bytes=1 << 20, timeout_s=120, rank=0)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
        stack.callback(trainer.shutdown)
        for seed, version in ((3, "v1"), (4, "v2")):
            state = synthetic_state(SIZE, TENSORS, "float32", seed=seed)
            stats = trainer.send_weights(TensorSource(state), weight_version=version)
            planned = sum(t.numel() * t.element_size() for t in state.values())
            assert stats.num_bytes == planned
            assert client.checksums() == [digest_named(state.items())] * 2  # bit for bit
            for info_ in client.weight_info():
                assert info_["weight_version"] == version and info_["consistent"] is True
                assert info_["round_bytes"] == {"planned": planned, "landed": planned}
