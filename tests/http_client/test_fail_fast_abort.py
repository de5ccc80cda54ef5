"""A failed round's best-effort abort is bounded on its own (issue 29, item 7).

The round's last update carries a non-finite tensor, which one receiver refuses
(``--reject-nonfinite``) while the other is SIGSTOPped. The fan-out gives the stopped one only ``FAIL_FAST_S`` more seconds, but the abort
that followed waited out the client's whole timeout for it (300 s by default); now the abort
has a short bound of its own and reaches every receiver at once.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from wtcore import ReceiverError, WeightTransferTrainerFactory
from wtcore.buckets import plan_buckets
from wtcore.source import TensorSource
from wtcore.testing.procs import freeze
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.fanout import ABORT_TIMEOUT_S, FAIL_FAST_S
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SIZE, TENSORS = 64 << 10, 12
BUCKET = 4 << 10
CLIENT_TIMEOUT_S = 120.0  # what the abort used to wait for the stopped receiver


class StoppingClient(HTTPWeightSyncClient):
    """The real HTTP client; it SIGSTOPs ``victim`` just before the round's last update, so
    that update reaches a refusing receiver and a stopped one at once."""

    victim: Any = None
    last_update = 0  # the plan's bucket count: one update per bucket
    updates = 0

    def update_weights(self, update_info: Any) -> None:
        self.updates += 1
        if self.updates == self.last_update:
            freeze(self.victim.proc.pid)
        super().update_weights(update_info)


def test_the_abort_after_a_failed_round_does_not_wait_for_a_stopped_receiver(
    start_server: Any,
) -> None:
    args = ("--size", str(SIZE), "--tensors", str(TENSORS), "--world-size", "2")
    strict = start_server("--rank", "0", "--reject-nonfinite", *args)
    frozen = start_server("--rank", "1", *args)
    state = synthetic_state(SIZE, TENSORS, "float32", seed=5)
    last = list(state)[-1]
    state[last] = torch.full_like(state[last], float("nan"))  # refused by `strict`
    try:
        with StoppingClient([strict.url, frozen.url], timeout_s=CLIENT_TIMEOUT_S) as client:
            client.victim = frozen
            client.last_update = len(plan_buckets(TensorSource(state).metadata(), BUCKET))
            trainer = WeightTransferTrainerFactory.trainer_init(
                InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=BUCKET), client=client
            )
            t0 = time.monotonic()
            with pytest.raises(ReceiverError) as err:
                trainer.send_weights(TensorSource(state), weight_version="x")
            elapsed = time.monotonic() - t0
            trainer.shutdown()
        # fail-fast for the update, then the abort's own bound: far below the client timeout
        assert elapsed < (CLIENT_TIMEOUT_S / 2), f"send_weights took {elapsed:.1f} s"
        assert ABORT_TIMEOUT_S <= FAIL_FAST_S
        labels = {f.receiver: f for f in err.value.failures}
        assert set(labels) == {strict.url, frozen.url}, str(err.value)
        assert labels[frozen.url].timed_out is True
        assert "non-finite" in str(err.value) or "nonfinite" in str(err.value), str(err.value)
        # the receiver that answered got the abort: nothing published
        (info,) = HTTPWeightSyncClient(strict.url, timeout_s=30).weight_info()
        assert (info["weight_version"], info["state"]) == (None, "idle")
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
