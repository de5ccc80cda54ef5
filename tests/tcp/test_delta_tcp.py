"""The delta-round suite on the tcp pair: real TCP streams, workers on threads."""

from __future__ import annotations

import pytest

from tests.tcp import test_contract_tcp  # its init info is reused
from wtcore.testing.delta import DeltaContractSuite

pytestmark = [pytest.mark.timeout(180)]


class TestTCPDelta(DeltaContractSuite):
    backend = "tcp"
    make_trainer_init_info = test_contract_tcp.TestTCPContract.make_trainer_init_info
