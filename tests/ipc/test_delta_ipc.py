"""The delta-round suite on the ipc pair (in-process receivers, real shared memory)."""

from __future__ import annotations

from wtcore.testing.delta import DeltaContractSuite
from wtcore_ipc import IPCTrainerInitInfo


class TestIPCDelta(DeltaContractSuite):
    backend = "ipc"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> IPCTrainerInitInfo:
        return IPCTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0)
