"""Hostile peers on tcp's fan-out: a flood of strangers on the sender's port, a stopped receiver.

Two receiver processes, real sockets on loopback. Strangers must hold up no one: 66 connections
that say nothing, opened on the sender's port just before the workers connect, used to fill
the sender's 64 greeters, and the workers' own connections were then reset (init failed). A
receiver stopped (SIGSTOP) mid-round must fail the round within its timeout plus a bounded
margin, naming it; it used to take about 4 timeouts, with "1 worker(s) have not yet taken it"
(the receiver stops itself as it posts the round's first receive: it took the round's start,
so nothing but the stop holds the round up).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.nccl.nccl_e2e_kit import Fleet, fleet, make_state
from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.errors import WtcoreError
from wtcore.testing import spec_of, wait_until
from wtcore_kit.fanout import ABORT_TIMEOUT_S
from wtcore_tcp import TCPTrainerInitInfo
from wtcore_tcp import trainer as tcp_trainer

if TYPE_CHECKING:
    from collections.abc import Iterator

    from wtcore.worker import WeightSyncWorker

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

TIMEOUT_S = 6.0
#: float32 elements of the big tensor: 96 MB, far more than loopback's socket buffers take.
BIG_NUMEL = 24_000_000
STRANGERS = 66


def _late(delay_s: float) -> float:
    """Runs in a worker's process: connect to the sender ``delay_s`` late (0: at once)."""
    from wtcore_tcp import streams

    honest = getattr(streams, "_honest_connect_lanes", streams.connect_lanes)
    streams._honest_connect_lanes = honest  # type: ignore[attr-defined]

    def connect_lanes(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return honest(*args, **kwargs)

    streams.connect_lanes = honest if not delay_s else connect_lanes  # type: ignore[assignment]
    return delay_s


def _stop_at_first_receive() -> bool:
    """Runs in a worker's process: stop it (SIGSTOP, every thread) as it posts the next
    round's first receive, when the first bucket goes out (once)."""
    from wtcore_tcp.streams import Stream

    honest = Stream.broadcast_parts

    def broadcast_parts(self: Stream, tensors: Any) -> Any:
        Stream.broadcast_parts = honest  # type: ignore[method-assign]
        os.kill(os.getpid(), signal.SIGSTOP)
        return honest(self, tensors)

    Stream.broadcast_parts = broadcast_parts  # type: ignore[method-assign]
    return True


def _handlers(worker: WeightSyncWorker) -> dict[str, Any]:
    return {"late": _late, "stop_at_first_receive": _stop_at_first_receive}


def _state(seed: int) -> dict[str, torch.Tensor]:
    return make_state(seed, big=BIG_NUMEL, count=20)


def _info() -> TCPTrainerInitInfo:
    return TCPTrainerInitInfo(
        address="127.0.0.1", world_size=3, topology="fanout", timeout_s=TIMEOUT_S, rank=0
    )


@pytest.fixture(scope="module")
def two() -> Iterator[Fleet]:
    """Two receiver processes (ranks 1 and 2 of a fan-out)."""
    with fleet(
        2, spec_of(_state(0)), timeout_s=5 * TIMEOUT_S, extra=_handlers, backend="tcp", options={}
    ) as f:
        yield f


def test_a_flood_of_silent_strangers_holds_up_no_worker(
    two: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    strangers: list[socket.socket] = []
    honest = tcp_trainer.accept

    def flooded(listener: socket.socket, **kwargs: Any) -> Any:
        for _ in range(STRANGERS):  # queued before the workers', which come 0.5 s late
            strangers.append(socket.create_connection(listener.getsockname()[:2], timeout=10))
        return honest(listener, **kwargs)

    monkeypatch.setattr(tcp_trainer, "accept", flooded)
    for i in range(2):
        two.client.call(i, "late", 0.5)
    try:
        t0 = time.monotonic()
        with WeightTransferTrainerFactory.trainer_init(_info(), client=two.client) as trainer:
            took = time.monotonic() - t0
            print(f"init with {len(strangers)} silent strangers: {took:.1f} s")
            assert len(strangers) == STRANGERS
            assert took < TIMEOUT_S
            state = _state(1)
            trainer.send_weights(TensorSource(state), weight_version="flooded")
            two.assert_synced(state, "flooded")
    finally:
        for s in strangers:
            s.close()
        for i in range(2):
            two.client.call(i, "late", 0.0)


def test_a_stopped_receiver_fails_the_round_within_its_timeout_naming_it(two: Fleet) -> None:
    victim = two.procs[1]  # rank 2
    with WeightTransferTrainerFactory.trainer_init(_info(), client=two.client) as trainer:
        good = _state(1)
        trainer.send_weights(TensorSource(good), weight_version="good")
        two.client.call(1, "stop_at_first_receive")
        t0 = time.monotonic()
        try:
            with pytest.raises(WtcoreError) as exc:
                trainer.send_weights(TensorSource(_state(2)), weight_version="bad")
            took = time.monotonic() - t0
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        print(f"stopped: after {took:.1f} s: {type(exc.value).__name__}: {exc.value}")
        # The timeout, then the trainer's abort of the round, which the stopped receiver does
        # not answer (bounded by ABORT_TIMEOUT_S), and a little slack for a loaded machine.
        assert took < TIMEOUT_S + ABORT_TIMEOUT_S + 4.0
        assert "not yet taken by rank 2 at 127.0.0.1:" in str(exc.value), exc.value
        wait_until(
            lambda: two.client.call(1, "weight_info")["state"] == "idle",
            3 * TIMEOUT_S,
            "the stopped receiver to end the round",
        )
        assert two.client.call(1, "weight_info")["weight_version"] == "good"

        fresh = _state(3)  # the next round re-runs the handshake and is bit-exact
        trainer.send_weights(TensorSource(fresh), weight_version="fresh")
        two.assert_synced(fresh, "fresh")
