"""End to end: one trainer (this process) and 1-3 worker processes over real gloo on loopback.

Each worker process holds its own ``WeightSyncWorker`` + ``ModuleSink``; the trainer drives
them through the pipe-based control plane (``wtcore.testing.pipes.PipeClient``). After every round the
workers' weights must be bit-exact copies of the trainer's.
"""

from __future__ import annotations

import pytest
import torch

from tests.nccl.nccl_e2e_kit import fleet, make_state
from wtcore import PayloadError, TensorSource, WeightTransferTrainerFactory
from wtcore.testing import free_port, spec_of
from wtcore_nccl import NCCLTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

#: 1 KiB (most tensors alone, the big one oversize), 16 KiB (mixed), 1 GiB (one bucket).
BUFFER_SIZES = (1 << 10, 16 << 10, 1 << 30)


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), f"{name}: values differ"


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_rounds_bit_exact_across_buffer_sizes_and_modes(num_workers: int) -> None:
    state0 = make_state(0)
    with fleet(num_workers, spec_of(state0)) as f:
        seed = 1
        for packed in (True, False):
            for buffer_size in BUFFER_SIZES:
                info = NCCLTrainerInitInfo(
                    master_address="127.0.0.1",
                    master_port=free_port(),
                    world_size=1 + num_workers,
                    packed=packed,
                    packed_buffer_size_bytes=buffer_size,
                    timeout_s=20.0,
                    torch_num_threads=1,
                    rank=0,
                )
                with WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer:
                    for _ in range(2):
                        state = make_state(seed)
                        seed += 1
                        version = f"{packed}-{buffer_size}-{seed}"
                        stats = trainer.send_weights(TensorSource(state), weight_version=version)
                        assert stats.num_tensors == len(state)
                        if packed and buffer_size == 1 << 30:
                            assert stats.num_buckets == 1
                        for i, got in enumerate(f.states()):
                            _assert_bit_exact(got, state)
                            assert f.client.call(i, "weight_info")["weight_version"] == version
                    # An empty source is refused before the round starts: a version is
                    # published only over weights a round changed (docs/protocol.md).
                    before = f.states()
                    with pytest.raises(PayloadError, match="no tensors"):
                        trainer.send_weights(TensorSource({}), weight_version="empty")
                    for i, got in enumerate(f.states()):
                        _assert_bit_exact(got, before[i])
                        assert f.client.call(i, "weight_info")["weight_version"] == version
