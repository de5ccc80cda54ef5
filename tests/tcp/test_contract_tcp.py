"""The wtcore contract suite on the tcp pair: real TCP streams, workers on threads."""

from __future__ import annotations

import pytest

from wtcore.testing.contract import EngineContractSuite
from wtcore_tcp import TCPTrainerInitInfo

pytestmark = [pytest.mark.timeout(120)]


class TestTCPContract(EngineContractSuite):
    backend = "tcp"
    timeout_s = 30.0

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> TCPTrainerInitInfo:
        return TCPTrainerInitInfo(
            address="127.0.0.1",
            world_size=1 + num_workers,
            packed_buffer_size_bytes=buffer_size_bytes,
            timeout_s=20.0,
            rank=0,
        )


class TestTCPContractUnpacked(TestTCPContract):
    """The same contract with one message per tensor."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> TCPTrainerInitInfo:
        info = super().make_trainer_init_info(
            num_workers=num_workers, buffer_size_bytes=buffer_size_bytes
        )
        info.packed = False
        return info


class TestTCPContractInPlaceChecksummed(TestTCPContract):
    """Every tensor of 64 bytes or more in place, and every frame with a CRC (staged)."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> TCPTrainerInitInfo:
        info = super().make_trainer_init_info(
            num_workers=num_workers, buffer_size_bytes=buffer_size_bytes
        )
        info.direct_min_bytes = 64
        info.checksum = True
        return info
