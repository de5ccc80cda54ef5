"""The wtcore contract and delta suites on the mooncake pair: in-process receivers, each with
a real Mooncake transfer engine (TCP on loopback), pulling from the trainer's registered
staging."""

from __future__ import annotations

from typing import Any, ClassVar

from wtcore.testing.contract import EngineContractSuite
from wtcore.testing.delta import DeltaContractSuite
from wtcore_mooncake import MooncakeTrainerInitInfo


class MooncakeInfo:
    """The suites' trainer init info, with this class's ``options`` on top."""

    backend = "mooncake"
    options: ClassVar[dict[str, Any]] = {}

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> MooncakeTrainerInitInfo:
        return MooncakeTrainerInitInfo(
            packed_buffer_size_bytes=buffer_size_bytes, timeout_s=30, rank=0, **self.options
        )


class TestMooncakeContract(MooncakeInfo, EngineContractSuite):
    pass


class TestMooncakeContractSingleBuffer(TestMooncakeContract):
    """One staging slot: every read is waited for before the slot is packed again."""

    options: ClassVar[dict[str, Any]] = {"packed_num_buffers": 1}


class TestMooncakeContractUnpacked(TestMooncakeContract):
    """Unpacked: one tensor per bucket, one read per tensor."""

    options: ClassVar[dict[str, Any]] = {"packed": False}


class TestMooncakeContractInPlace(TestMooncakeContract):
    """Every tensor of 64 bytes or more read straight into the sink's tensor, the rest packed."""

    options: ClassVar[dict[str, Any]] = {"direct_min_bytes": 64}


class TestMooncakeDelta(MooncakeInfo, DeltaContractSuite):
    pass


class TestMooncakeDeltaInPlace(TestMooncakeDelta):
    options: ClassVar[dict[str, Any]] = {"direct_min_bytes": 64}
