"""CUDA paths. They need a GPU and are skipped without one (this suite's CI host has none).

One GPU: CUDA tensors through a gloo group (staging buffers on the device). NCCL itself needs
one GPU per rank, so the NCCL round trip runs only with two or more GPUs.
"""

from __future__ import annotations

import pytest
import torch

from wtcore import ModuleSink, TensorSource, WeightSyncWorker
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.testing import build_module, free_port, mixed_dtype_state, zeros_like_state
from wtcore_kit.inproc import InProcessClient
from wtcore_nccl import NCCLTrainerInitInfo

pytestmark = [
    pytest.mark.processes,
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _round_trip(transport: str, trainer_device: str, worker_device: str, packed: bool) -> None:
    state = {k: v.to(trainer_device) for k, v in mixed_dtype_state(seed=11).items()}
    module = build_module(zeros_like_state(state)).to(worker_device)
    worker = WeightSyncWorker("nccl", ModuleSink(module), device=worker_device)
    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        packed=packed,
        packed_buffer_size_bytes=4096,
        timeout_s=60,
        transport=transport,
        device=trainer_device,
        rank=0,
    )
    try:
        with WeightTransferTrainerFactory.trainer_init(
            info, client=InProcessClient(worker, timeout_s=60)
        ) as trainer:
            for step in range(2):
                trainer.send_weights(TensorSource(state), weight_version=f"s{step}")
                held = dict(module.named_parameters())
                for name, t in state.items():
                    assert torch.equal(held[name].detach().cpu(), t.cpu()), name
    finally:
        worker.shutdown()


@pytest.mark.parametrize("packed", [True, False])
def test_cuda_tensors_over_gloo(packed: bool) -> None:
    _round_trip("gloo", "cuda:0", "cuda:0", packed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("packed", [True, False])
def test_nccl_between_two_gpus(packed: bool) -> None:
    _round_trip("auto", "cuda:0", "cuda:1", packed)
