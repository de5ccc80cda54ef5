"""The delta-round suite on the nccl pair: real gloo groups, workers on threads."""

from __future__ import annotations

import pytest

from tests.nccl import test_contract_nccl  # its init info is reused
from wtcore.testing.delta import DeltaContractSuite


class TestNCCLDelta(DeltaContractSuite):
    backend = "nccl"
    make_trainer_init_info = test_contract_nccl.TestNCCLContract.make_trainer_init_info


pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]
