"""The wtcore contract suite on the nccl pair: real gloo groups, workers on threads."""

from __future__ import annotations

import pytest

from wtcore.testing import free_port
from wtcore.testing.contract import EngineContractSuite
from wtcore_nccl import NCCLTrainerInitInfo


class TestNCCLContract(EngineContractSuite):
    backend = "nccl"
    timeout_s = 30.0

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> NCCLTrainerInitInfo:
        return NCCLTrainerInitInfo(
            master_address="127.0.0.1",
            master_port=free_port(),
            world_size=1 + num_workers,
            packed_buffer_size_bytes=buffer_size_bytes,
            timeout_s=20.0,
            rank=0,
        )


class TestNCCLContractUnpacked(TestNCCLContract):
    """The same contract with one broadcast per tensor."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> NCCLTrainerInitInfo:
        info = super().make_trainer_init_info(
            num_workers=num_workers, buffer_size_bytes=buffer_size_bytes
        )
        info.packed = False
        return info


pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


class TestNCCLContractInPlace(TestNCCLContract):
    """The same contract with every tensor of 64 bytes or more travelling in place."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> NCCLTrainerInitInfo:
        info = super().make_trainer_init_info(
            num_workers=num_workers, buffer_size_bytes=buffer_size_bytes
        )
        info.direct_min_bytes = 64
        return info
