"""A trainer that dies or hangs mid-round: the receiver's blocking receive can be taken over.

The trainer runs in a spawned process and drives a real ``WeightSyncWorker`` that lives in
this process (served on a thread over a pipe), so the test can do what the receiver state
machine does when a restarted trainer's init arrives while ``update_weights`` still waits on
the old one: call ``engine.abort()``. The receive must end within moments, not after the
engine's timeout, and a new trainer then syncs the receiver bit-exact.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

import pytest
import torch

from tests.nccl.nccl_e2e_kit import loopback_info, make_state
from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.source import WeightSource
from wtcore.testing import build_module, wait_until, zeros_like_state
from wtcore.testing.pipes import PipeClient, serve, worker_handlers
from wtcore.testing.procs import freeze
from wtcore_kit.inproc import InProcessClient
from wtcore_nccl import NCCLTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

#: The engines' timeout: four times the takeover bound (a hung trainer's gloo group ends
#: only at it, and the test waits that long).
TIMEOUT_S = 20.0
#: How soon after ``abort()`` the stuck receive must have ended.
TAKEOVER_S = 5.0


def _info() -> NCCLTrainerInitInfo:
    return loopback_info(
        world_size=2,
        packed_buffer_size_bytes=1 << 10,
        timeout_s=TIMEOUT_S,
        torch_num_threads=1,
    )


class _StallingSource(WeightSource):
    """Yields ``inner``'s first ``at`` tensors, says so, then blocks (a hung trainer)."""

    def __init__(self, inner: WeightSource, at: int, stalled: Event) -> None:
        self.inner, self.at, self.stalled = inner, at, stalled

    def metadata(self) -> list[Any]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.at:
                self.stalled.set()
                time.sleep(3600)
            yield item


def _trainer_main(conn: Connection, info: NCCLTrainerInitInfo, stalled: Event) -> None:
    """Child: one good round, then a round that stalls after some buckets went out."""
    torch.set_num_threads(1)
    client = PipeClient([conn], timeout_s=2 * TIMEOUT_S)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
    trainer.send_weights(TensorSource(make_state(1, count=40)), weight_version="v1")
    trainer.send_weights(
        _StallingSource(TensorSource(make_state(2, count=40)), 20, stalled), weight_version="v2"
    )


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_new_trainer_takes_over_a_receive_stuck_on_a_dead_or_hung_trainer(how: str) -> None:
    state = make_state(0, count=40)
    module = build_module(zeros_like_state(state))
    worker = WeightSyncWorker({"backend": "nccl"}, ModuleSink(module))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    stalled = ctx.Event()
    server = threading.Thread(
        target=serve, args=(parent, worker_handlers(lambda: worker)), daemon=True
    )
    server.start()
    proc = ctx.Process(target=_trainer_main, args=(child, _info(), stalled), daemon=True)
    proc.start()
    try:
        assert stalled.wait(120), "the trainer process never reached its stall"
        wait_until(lambda: worker.weight_info()["state"] == "updating", 30, "the round")
        assert worker.weight_info()["weight_version"] == "v1"
        if how == "killed":
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        else:
            freeze(proc.pid)
        time.sleep(1.0)  # a receive on a live-but-silent (or just-closed) peer still waits
        # What the receiver state machine does when a new init arrives mid-call:
        t0 = time.monotonic()
        worker.engine.abort()
        wait_until(
            lambda: worker.weight_info()["state"] != "updating", TAKEOVER_S, "the receive to end"
        )
        assert time.monotonic() - t0 < TAKEOVER_S
        info = worker.weight_info()
        assert (info["weight_version"], info["consistent"]) == ("v1", False)
        # A restarted trainer syncs the receiver, bit-exact.
        fresh = make_state(3, count=40)
        with WeightTransferTrainerFactory.trainer_init(
            _info(), client=InProcessClient([worker])
        ) as trainer:
            trainer.send_weights(TensorSource(fresh), weight_version="v3")
        info = worker.weight_info()
        assert (info["weight_version"], info["consistent"]) == ("v3", True)
        got = dict(module.named_parameters())
        for name, t in fresh.items():
            assert torch.equal(got[name], t), name
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        parent.close()
        worker.shutdown()
        assert not proc.is_alive()
