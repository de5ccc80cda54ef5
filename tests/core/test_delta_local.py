"""The delta-round suite on the built-in ``local`` engine pair."""

from __future__ import annotations

from wtcore.local import LocalTrainerInitInfo
from wtcore.testing.delta import DeltaContractSuite


class TestLocalDelta(DeltaContractSuite):
    backend = "local"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> LocalTrainerInitInfo:
        return LocalTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, rank=0)
