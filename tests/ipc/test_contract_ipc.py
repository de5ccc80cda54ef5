"""The wtcore contract suite on the ipc pair (in-process receivers, real shared memory)."""

from __future__ import annotations

from wtcore.testing.contract import EngineContractSuite
from wtcore_ipc import IPCTrainerInitInfo


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
