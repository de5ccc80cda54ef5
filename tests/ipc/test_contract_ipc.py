"""The wtcore contract suite on the ipc pair (in-process receivers, real shared memory)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from wtcore.source import TensorSource, WeightSource
from wtcore.testing.contract import EngineContractSuite
from wtcore_ipc import IPCTrainerInitInfo, share_weights


class TestIPCContract(EngineContractSuite):
    backend = "ipc"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> IPCTrainerInitInfo:
        return IPCTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0)


class TestIPCContractSingleBuffer(TestIPCContract):
    """One staging buffer: every call is waited for before the buffer is packed again."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> IPCTrainerInitInfo:
        return IPCTrainerInitInfo(
            packed_buffer_size_bytes=buffer_size_bytes, packed_num_buffers=1, timeout_s=30, rank=0
        )


class TestIPCContractUnpacked(TestIPCContract):
    """Unpacked mode: one tensor per update_weights call."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> IPCTrainerInitInfo:
        return IPCTrainerInitInfo(
            packed=False, packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0
        )


class TestIPCContractSharedWeights(TestIPCContract):
    """The trainer's tensors live in shared memory (``share_weights``): each round sends their
    offsets in one call and every worker copies straight out of them."""

    @contextmanager
    def source_for(self, state: Mapping[str, torch.Tensor]) -> Iterator[WeightSource]:
        with share_weights(state) as shared:
            source = TensorSource(state)
            assert all(shared.offset_of(t) is not None for t in state.values())
            yield source
