"""The delta-round suite on the nccl pair: real gloo groups, workers on threads."""

from __future__ import annotations

import pytest

from wtcore.testing import free_port
from wtcore.testing.delta import DeltaContractSuite
from wtcore_nccl import NCCLTrainerInitInfo


class TestNCCLDelta(DeltaContractSuite):
    backend = "nccl"

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


pytestmark = [pytest.mark.timeout(180)]
