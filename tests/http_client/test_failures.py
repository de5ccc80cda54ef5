"""Receivers that die, hang or were never there: the client raises in time, naming the URL."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from wtcore import ReceiverError, TensorSource, TransferTimeoutError, WeightTransferTrainerFactory
from wtcore.testing import KillingSource, free_port
from wtcore.testing.procs import freeze
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient, ReceiverTimeoutError
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

SIZE, TENSORS = 64 << 10, 12
TIMEOUT_S = 3.0
SLACK_S = 5.0  # fan-out grace plus a busy machine


def _pair(start_server: Any) -> list[Any]:
    args = ("--size", str(SIZE), "--tensors", str(TENSORS), "--world-size", "2")
    return [start_server("--rank", str(r), *args) for r in range(2)]


def test_server_killed_mid_round(start_server: Any) -> None:
    alive, doomed = _pair(start_server)
    state = synthetic_state(SIZE, TENSORS, "float32", seed=3)
    with (
        HTTPWeightSyncClient([alive.url, doomed.url], timeout_s=TIMEOUT_S) as client,
        HTTPWeightSyncClient(doomed.url, timeout_s=TIMEOUT_S) as doomed_client,
    ):
        trainer = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=8 << 10), client=client
        )
        t0 = time.monotonic()
        with pytest.raises(ReceiverError) as err:
            trainer.send_weights(
                KillingSource(
                    TensorSource(state),
                    lambda: doomed.stop(signal.SIGKILL),
                    at=1,
                    once=lambda: doomed_client.weight_info()[0]["state"] == "updating",
                ),
                weight_version="x",
            )
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
        assert doomed.proc.poll() is not None
        assert err.value.call == "update_weights"
        assert [f.receiver for f in err.value.failures] == [doomed.url], str(err.value)
        failure = err.value.failures[0]
        assert failure.status is None and failure.error_type == "HTTPConnectionError"
        assert f"{doomed.url}: HTTPConnectionError: POST /update_weights" in str(err.value)
        assert err.value.total == 2
        # the trainer aborted the round on the survivor: it published nothing, and says
        # that the round's first buckets are in
        (info,) = HTTPWeightSyncClient(alive.url, timeout_s=TIMEOUT_S).weight_info()
        assert (info["weight_version"], info["state"], info["consistent"]) == (None, "idle", False)
        assert "abort_weight_update" in info["last_error"]


def test_hung_server_times_out(start_server: Any) -> None:
    alive, frozen = _pair(start_server)
    with HTTPWeightSyncClient([alive.url, frozen.url], timeout_s=TIMEOUT_S) as client:
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 8 << 10})
        freeze(frozen.proc.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(ReceiverTimeoutError) as err:
                client.start_weight_update()
            elapsed = time.monotonic() - t0
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
    assert TIMEOUT_S - 0.5 <= elapsed < TIMEOUT_S + SLACK_S
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, ReceiverError)
    assert [f.receiver for f in err.value.failures] == [frozen.url]
    assert err.value.failures[0].error_type == "TransferTimeoutError"
    assert f"no answer within {TIMEOUT_S:g} s" in str(err.value)


def test_nothing_listening() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with HTTPWeightSyncClient(url, timeout_s=TIMEOUT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(ReceiverError) as err:
            client.init_weight_transfer_engine({})
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert err.value.failures[0].receiver == url
    assert "Connection refused" in str(err.value) or "ConnectionError" in str(err.value)


def test_timeout_error_type_is_catchable_as_timeout() -> None:
    assert issubclass(ReceiverTimeoutError, TransferTimeoutError)
