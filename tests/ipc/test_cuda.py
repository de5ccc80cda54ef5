"""CUDA IPC across two processes on one GPU (skipped without a GPU; never run here yet)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.testing import RecordingClient
from wtcore_ipc import IPCTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.gpu, pytest.mark.timeout(180)]


def test_cuda_ipc_round_trip_bit_exact_without_memory_growth(procs: Any) -> None:
    state = {k: v.to("cuda:0") for k, v in procs.make_state(11, big=1 << 20).items()}
    worker = procs.PipeWorker()
    trainer = None
    try:
        worker.setup(state, "cuda:0")
        client = RecordingClient(procs.PipeClient([worker], timeout_s=120))
        info = IPCTrainerInitInfo(
            packed_buffer_size_bytes=1 << 20, device="cuda:0", timeout_s=60, rank=0
        )
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=TensorSource(state)
        )
        worker_mem, trainer_mem = [], []
        for step in range(4):
            for t in state.values():
                if t.dtype == torch.bool:
                    t.logical_not_()
                elif t.numel():
                    t.add_(1)
            trainer.send_weights(weight_version=f"s{step}")
            got = worker.dump()
            for name, want in state.items():
                assert torch.equal(got[name], want.cpu()), name
            worker_mem.append(worker.call("cuda_memory"))
            trainer_mem.append(torch.cuda.memory_allocated())
        assert len(set(worker_mem[1:])) == 1, f"worker GPU memory grows: {worker_mem}"
        assert len(set(trainer_mem[1:])) == 1, f"trainer GPU memory grows: {trainer_mem}"
        handles = {p["cuda"]["handle"] for c, p in client.calls if c == "update_weights"}
        assert len(handles) == info.packed_num_buffers, "one export per staging buffer"
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.stop()
