"""The kit's trainer waits for ``update_weights`` a little beyond ``timeout_s``
(:data:`wtcore_kit.bucketed.SETTLE_GRACE_S`), so a client whose own timeout of ``timeout_s`` ends the
call reports first, naming the receiver, instead of a bare "did not return"."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, ModuleSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import TransferTimeoutError
from wtcore_kit.bucketed import SETTLE_GRACE_S
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient

TIMEOUT_S = 1.0


class LateClient(InProcessClient):
    """Times its ``update_weights`` out as a network client would: after ``timeout_s`` (plus a
    little scheduling), naming the receiver."""

    def update_weights(self, update_info: Any) -> None:
        time.sleep(TIMEOUT_S + 0.2)
        raise TransferTimeoutError("http://10.0.0.9:8100: no answer within 1 s")


@pytest.mark.timeout(60)
def test_the_clients_own_timeout_naming_the_receiver_ends_the_call() -> None:
    assert SETTLE_GRACE_S >= 1.0
    worker = WeightSyncWorker("inline", ModuleSink(torch.nn.Linear(8, 4)))
    info = InlineTrainerInitInfo(rank=0, timeout_s=TIMEOUT_S)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=LateClient(worker), source=ModuleSource(torch.nn.Linear(8, 4))
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError) as caught:
            engine.send_weights(weight_version="late")
        took = time.monotonic() - t0
        assert "10.0.0.9" in str(caught.value), caught.value  # not "did not return within"
        assert took < TIMEOUT_S + SETTLE_GRACE_S + 1.0, took
    finally:
        engine.shutdown()
        worker.shutdown()
