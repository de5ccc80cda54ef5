"""Failures with real worker processes: each raises within its timeout, nothing is left behind.

``fleet`` (in ``nccl_e2e_kit``) asserts on exit that every worker process it started is gone,
and yields only once every worker answered, so no timer here includes a worker's start (two
test runs may share a small machine). Timeouts that are not under test have wide margins.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.nccl.nccl_e2e_kit import Fleet, fleet, loopback_info, make_state
from wtcore import (
    PayloadError,
    ReceiverError,
    TensorSource,
    TransferError,
    TransferTimeoutError,
    WeightTransferTrainerFactory,
)
from wtcore.testing import KillingSource, MismatchedSource, spec_of, wait_until
from wtcore.testing.procs import stop_processes
from wtcore_nccl import NCCLTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TIMEOUT_S = 20.0


def _info(world_size: int, **kw: object) -> NCCLTrainerInitInfo:
    opts: dict[str, object] = {
        "packed_buffer_size_bytes": 4 << 10,
        "timeout_s": TIMEOUT_S,
        "torch_num_threads": 1,
        **kw,
    }
    return loopback_info(world_size=world_size, **opts)


@pytest.fixture(scope="module")
def two() -> Iterator[Fleet]:
    """Two worker processes shared by the failure tests that leave them healthy."""
    with fleet(2, spec_of(make_state(0)), timeout_s=2 * TIMEOUT_S) as f:
        yield f


def _kill(proc: Any) -> None:
    """SIGKILL ``proc`` and reap it: a worker that dies without a word."""
    stop_processes([proc], 0, sig=signal.SIGKILL)


def _assert_round_failed(f: Fleet, i: int, *, version: str | None) -> None:
    wait_until(
        lambda: f.client.call(i, "weight_info")["state"] == "idle",
        TIMEOUT_S,
        f"worker {i} to end the round",
    )
    info = f.client.call(i, "weight_info")
    assert info["weight_version"] == version
    assert info["consistent"] is False


@pytest.mark.parametrize("kind", ["reshaped", "missing", "reordered"])
def test_metadata_mismatch_raises_then_next_round_recovers(two: Fleet, kind: str) -> None:
    good = make_state(1)
    with WeightTransferTrainerFactory.trainer_init(_info(3), client=two.client) as trainer:
        trainer.send_weights(TensorSource(good), weight_version="good")
        t0 = time.monotonic()
        with pytest.raises(PayloadError, match="metadata"):
            trainer.send_weights(
                MismatchedSource(TensorSource(make_state(2)), kind), weight_version="bad"
            )
        assert time.monotonic() - t0 < TIMEOUT_S
        for i in range(2):
            _assert_round_failed(two, i, version="good")
        print("worker saw:", two.client.call(0, "weight_info")["last_error"])
        # The next round re-runs the handshake on a fresh group and is bit-exact again.
        fresh = make_state(3)
        trainer.send_weights(TensorSource(fresh), weight_version="fresh")
        for i, got in enumerate(two.states()):
            assert two.client.call(i, "weight_info")["weight_version"] == "fresh"
            for name, t in fresh.items():
                assert torch.equal(got[name], t), name


def test_world_size_too_small_is_rejected_by_the_worker_at_once(two: Fleet) -> None:
    t0 = time.monotonic()
    with pytest.raises(ReceiverError, match=r"worker\[rank=1\].*world_size"):
        WeightTransferTrainerFactory.trainer_init(_info(2), client=two.client)
    assert time.monotonic() - t0 < TIMEOUT_S / 2  # fail fast, no rendezvous timeout


def test_world_size_too_large_times_out_naming_the_arrived_ranks(two: Fleet) -> None:
    info = _info(4, timeout_s=3.0)
    t0 = time.monotonic()
    # Both sides time out after 3 s; whichever reports first, the error names the ranks (the
    # workers' own timeout arrives wrapped in a ReceiverError when it wins the race).
    with pytest.raises((TransferTimeoutError, ReceiverError)) as exc:
        WeightTransferTrainerFactory.trainer_init(info, client=two.client)
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0 + 10.0  # the 3 s under test, plus a margin for a loaded machine
    msg = str(exc.value)
    assert f"127.0.0.1:{info.master_port}" in msg and "world_size 4" in msg
    assert "ranks [0, 1, 2] arrived" in msg and "[3] never" in msg
    # The workers time out on their own side too, and stay usable afterwards.
    with WeightTransferTrainerFactory.trainer_init(_info(3), client=two.client) as trainer:
        state = make_state(4)
        trainer.send_weights(TensorSource(state), weight_version="after")
        for got in two.states():
            assert all(torch.equal(got[n], t) for n, t in state.items())


def test_rendezvous_port_in_use_is_a_clear_error(two: Fleet) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=f"127.0.0.1:{port}.*already in use"):
            WeightTransferTrainerFactory.trainer_init(_info(3, master_port=port), client=two.client)
        assert time.monotonic() - t0 < TIMEOUT_S
    for i in range(2):  # the workers were never contacted
        assert two.client.call(i, "weight_info")["state"] in ("uninitialized", "idle")


@pytest.mark.parametrize("packed", [True, False])
def test_worker_killed_mid_transfer(packed: bool) -> None:
    state = make_state(5, count=400)
    info = _info(3, packed=packed, packed_buffer_size_bytes=1 << 10)
    with (
        fleet(2, spec_of(state), timeout_s=TIMEOUT_S) as f,
        WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer,
    ):
        trainer.send_weights(TensorSource(state), weight_version="v1")
        victim = f.procs[1]
        t0 = time.monotonic()
        with pytest.raises((TransferError, ReceiverError)) as exc:
            trainer.send_weights(
                KillingSource(
                    TensorSource(make_state(6, count=400)), lambda: _kill(victim), at=200
                ),
                weight_version="v2",
            )
        assert time.monotonic() - t0 < TIMEOUT_S
        assert not victim.is_alive()
        print(f"killed worker -> {type(exc.value).__name__}: {exc.value}")
        # The survivor's update ends with an error instead of waiting forever.
        _assert_round_failed(f, 0, version="v1")
        print("survivor:", f.client.call(0, "weight_info")["last_error"])
