"""The delta-round suite on the ipc pair (in-process receivers, real shared memory)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from wtcore.source import TensorSource
from wtcore.testing.delta import DeltaContractSuite
from wtcore_ipc import IPCTrainerInitInfo, share_weights


class TestIPCDelta(DeltaContractSuite):
    backend = "ipc"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> IPCTrainerInitInfo:
        return IPCTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0)


class TestIPCDeltaSharedWeights(TestIPCDelta):
    """Delta rounds from a trainer whose tensors live in shared memory: full rounds copy
    straight out of them, patch rounds go through the ring, both bit-exact."""

    @contextmanager
    def source_for(self, state: dict[str, torch.Tensor]) -> Iterator[TensorSource]:
        with share_weights(state):
            yield TensorSource(state)
