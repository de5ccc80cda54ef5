"""The wtcore contract and delta suites on the mooncake pair: in-process receivers, each with
a real Mooncake transfer engine (TCP on loopback), reading the trainer's tensors where they
lie (source reads, the default) or pulling from its registered staging slots."""

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
    """Source reads: the workers read the trainer's tensors where they lie."""

    options: ClassVar[dict[str, Any]] = {"source_reads": True}


class TestMooncakeContractSlots(TestMooncakeContract):
    """Every bucket packed into the trainer's two slots, each read out of its slot."""

    options: ClassVar[dict[str, Any]] = {"source_reads": False}


class TestMooncakeContractSingleBuffer(TestMooncakeContract):
    """One staging slot: every read is waited for before the slot is packed again."""

    options: ClassVar[dict[str, Any]] = {"packed_num_buffers": 1, "source_reads": False}


class TestMooncakeContractUnpacked(TestMooncakeContract):
    """Unpacked: one tensor per bucket, one read per tensor."""

    options: ClassVar[dict[str, Any]] = {"packed": False}


class TestMooncakeContractInPlace(TestMooncakeContract):
    """Slots, and every tensor of 64 bytes or more a bucket of its own, read straight into the
    sink's tensor, the rest packed."""

    options: ClassVar[dict[str, Any]] = {"direct_min_bytes": 64, "source_reads": False}


class TestMooncakeDelta(MooncakeInfo, DeltaContractSuite):
    pass


class TestMooncakeDeltaInPlace(TestMooncakeDelta):
    options: ClassVar[dict[str, Any]] = {"direct_min_bytes": 64, "source_reads": False}
