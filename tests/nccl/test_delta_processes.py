"""Delta rounds over nccl (gloo) with real worker processes: a chain of real training steps."""

from __future__ import annotations

import pytest

from tests.nccl.nccl_e2e_kit import fleet
from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.testing import free_port, spec_of
from wtcore.testing.delta import delta_chain
from wtcore_nccl import NCCLTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


def test_delta_chain_across_processes() -> None:
    full = delta_chain()
    chain = full[:5] + full[-2:]  # real steps, then no change, then everything changed
    state = {n: t.clone() for n, t in chain[0].items()}
    with fleet(2, spec_of(state)) as f:
        info = NCCLTrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=3,
            packed_buffer_size_bytes=1 << 18,
            timeout_s=30.0,
            torch_num_threads=1,
            delta=True,
            rank=0,
        )
        source = TensorSource(state)
        with WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer:
            modes = []
            for step, new in enumerate(chain):
                for name, t in state.items():
                    t.copy_(new[name])
                stats = trainer.send_weights(source, weight_version=f"s{step}")
                assert stats.delta is not None
                modes.append((stats.delta["mode"], stats.num_bytes))
                f.assert_synced(new, f"s{step}")  # torch.equal: bf16 steps hold no NaN
            header = trainer.rounds.tracker.mark()[1].numel()  # a full round names its trainer
    model = sum(t.numel() * t.element_size() for t in state.values())
    assert modes[0] == ("full", model + header)
    assert all(mode == "delta" for mode, _ in modes[1:])
    assert all(nbytes * 3 < model for _, nbytes in modes[1:-1])
