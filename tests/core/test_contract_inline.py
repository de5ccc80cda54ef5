"""The contract suite on the built-in ``inline`` engine pair."""

from __future__ import annotations

from wtcore.testing.contract import EngineContractSuite
from wtcore_kit.inline import InlineTrainerInitInfo


class TestLocalContract(EngineContractSuite):
    backend = "inline"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> InlineTrainerInitInfo:
        return InlineTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, rank=0)
