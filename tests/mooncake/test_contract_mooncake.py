"""The wtcore contract and delta suites on the mooncake pair: in-process receivers, each with
a real Mooncake transfer engine (TCP on loopback), pulling from the trainer's registered
staging."""

from __future__ import annotations

from wtcore.testing.contract import EngineContractSuite
from wtcore.testing.delta import DeltaContractSuite
from wtcore_mooncake import MooncakeTrainerInitInfo


class TestMooncakeContract(EngineContractSuite):
    backend = "mooncake"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> MooncakeTrainerInitInfo:
        return MooncakeTrainerInitInfo(
            packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0
        )


class TestMooncakeContractSingleBuffer(TestMooncakeContract):
    """One staging slot: every read is waited for before the slot is packed again."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> MooncakeTrainerInitInfo:
        return MooncakeTrainerInitInfo(
            packed_buffer_size_bytes=buffer_size_bytes, packed_num_buffers=1, timeout_s=30, rank=0
        )


class TestMooncakeContractUnpacked(TestMooncakeContract):
    """Unpacked: one tensor per bucket, one read per tensor."""

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> MooncakeTrainerInitInfo:
        return MooncakeTrainerInitInfo(
            packed=False, packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0
        )


class TestMooncakeDelta(DeltaContractSuite):
    backend = "mooncake"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> MooncakeTrainerInitInfo:
        return MooncakeTrainerInitInfo(
            packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0
        )
