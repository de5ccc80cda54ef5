"""The GPU engines between processes (skipped without CUDA; run by scripts/gpu-check.sh).

* One GPU: ``wtcore bench --device cuda`` for nccl (gloo over CUDA tensors: NCCL needs one GPU
  per rank) and ipc (CUDA IPC), with real ``wtcore serve`` receiver processes; every round is
  verified against the trainer's digests by the bench.
* Two GPUs: the NCCL transport itself, trainer on ``cuda:0`` and a receiver process on
  ``cuda:1``, checked against the trainer's digests after every round; the same for a
  sharded round (one trainer rank, its parts on the GPU, then on the CPU), whose steps go as
  NCCL groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore_bench import BenchOptions, ModelSpec, run_bench

pytestmark = [
    pytest.mark.processes,
    pytest.mark.gpu,
    pytest.mark.timeout(100),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_engine_between_processes_on_one_gpu(backend: str) -> None:
    record = run_bench(
        BenchOptions(
            backend=backend,
            client="http",
            receivers=2,
            size_bytes=8 << 20,
            num_tensors=40,
            rounds=2,
            buffer_sizes=[1 << 20],
            baselines="none",
            device="cuda",
            timeout_s=60,
        )
    )
    assert record["ok"] is True, record["runs"]
    assert record["settings"]["device"] == "cuda"
    assert all(r["mismatched_tensors"] == [0, 0] for r in record["runs"][0]["rounds"])


@contextlib.contextmanager
def _on_two_gpus(spec: ModelSpec, buffer_size_bytes: int) -> Iterator[tuple[Any, Any, Any]]:
    """A ``wtcore serve`` receiver process on ``cuda:1`` holding ``spec``'s model, and the
    trainer's copy on ``cuda:0``: yields that model, an NCCL init info and an HTTP client."""
    from wtcore.testing.net import free_port
    from wtcore_bench.serve import launch_serve
    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_kit.synthetic import build_module
    from wtcore_nccl import NCCLTrainerInitInfo

    server = launch_serve(
        ["--backend", "nccl", "--device", "cuda:1", "--size", str(spec.size_bytes),
         "--tensors", str(spec.num_tensors), "--dtype", spec.dtype, "--seed", str(spec.seed)]
    )  # fmt: skip
    try:
        model = build_module(spec.build_state()).to("cuda:0")
        info = NCCLTrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=2,
            packed_buffer_size_bytes=buffer_size_bytes,
            transport="nccl",
            device="cuda:0",
            timeout_s=60,
            rank=0,
        )
        client = HTTPWeightSyncClient([server.url], timeout_s=60)
        try:
            yield model, info, client
        finally:
            client.close()
    finally:
        server.stop(timeout_s=10)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_transport_between_processes_on_two_gpus() -> None:
    from wtcore.digest import digest_named
    from wtcore.factory import WeightTransferTrainerFactory
    from wtcore.source import ModuleSource

    spec = ModelSpec(8 << 20, 40, "bfloat16", seed=0)
    with (
        _on_two_gpus(spec, 1 << 20) as (model, info, client),
        WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=ModuleSource(model)
        ) as trainer,
    ):
        for step in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            trainer.send_weights(weight_version=f"s{step}")
            want = digest_named(model.named_parameters())
            (got,) = client.checksums()
            assert got == want, sorted(n for n in want if got.get(n) != want[n])[:3]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_sharded_round_over_nccl_between_processes_on_two_gpus() -> None:
    """A sharded round over the NCCL transport (M=1, N=1): trainer rank 0 on ``cuda:0``, a
    receiver process on ``cuda:1``, one group of 1 + 1 ranks formed for each round, every
    step one NCCL group (wtcore_nccl.pairs). Round 0 sends parts held on the GPU, round 1
    parts held on the CPU (staged onto ``cuda:0`` by the packing); after each the receiver's
    checksums equal the trainer's digests and the trainer sent exactly its planned bytes."""
    from wtcore.digest import digest_named
    from wtcore.factory import WeightTransferTrainerFactory
    from wtcore.sharded.layout import Layout
    from wtcore.testing.sharded import PartsSource

    spec = ModelSpec(4 << 20, 30, "bfloat16", seed=0)
    # 256 KiB buckets: several steps of 2 buckets
    with (
        _on_two_gpus(spec, 256 << 10) as (model, info, client),
        WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer,
    ):
        for step, held_on in enumerate(["cuda:0", "cpu"]):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            full = {n: p.detach().to(held_on) for n, p in model.named_parameters()}
            layouts = {n: Layout.whole(t.shape, owner=0, world_size=1) for n, t in full.items()}
            stats = trainer.send_weights(
                PartsSource(full, layouts, 0), weight_version=f"sharded-{step}"
            )
            assert stats.bytes_sent == stats.num_bytes == sum(t.nbytes for t in full.values())
            want = digest_named(model.named_parameters())
            (got,) = client.checksums()
            assert got == want, (held_on, sorted(n for n in want if got.get(n) != want[n])[:3])
