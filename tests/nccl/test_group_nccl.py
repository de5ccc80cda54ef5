"""The transfer group's rendezvous, and unblocking a worker stuck in a receive.

Real TCP stores and gloo groups on loopback; ranks run on threads of this process.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from wtcore import ModuleSink, TensorSource, TransferError, TransferTimeoutError, WeightSyncWorker
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.source import WeightSource
from wtcore.testing import build_module, free_port, zeros_like_state
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.inproc import InProcessClient
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_nccl.group import connect_store, host_store, join_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]


def _join(store: object, rank: int, world_size: int, port: int, timeout_s: float) -> object:
    return join_group(
        store,
        generation=1,
        rank=rank,
        world_size=world_size,
        transport="gloo",
        address="127.0.0.1",
        port=port,
        timeout_s=timeout_s,
    )


def test_group_forms_and_broadcasts_without_the_default_group() -> None:
    port = free_port()
    master = host_store("127.0.0.1", port, 2, 10)
    calls = [BackgroundCall(_join, master, 0, 2, port, 10)]
    calls.append(BackgroundCall(_join, connect_store("127.0.0.1", port, 10), 1, 2, port, 10))
    g0, g1 = (c.result(10) for c in calls)
    src, dst = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    w1 = g1.broadcast(dst)  # type: ignore[attr-defined]
    g0.broadcast(src).wait()  # type: ignore[attr-defined]
    w1.wait()
    assert torch.equal(src, dst)
    assert not torch.distributed.is_initialized()


def test_missing_rank_times_out_naming_who_arrived() -> None:
    port = free_port()
    master = host_store("127.0.0.1", port, 3, 10)
    peer = BackgroundCall(_join, connect_store("127.0.0.1", port, 10), 2, 3, port, 1.5)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError) as exc:
        _join(master, 0, 3, port, 1.5)
    assert time.monotonic() - t0 < 5
    msg = str(exc.value)
    assert f"127.0.0.1:{port}" in msg and "world_size 3" in msg
    assert "ranks [0, 2] arrived" in msg and "ranks [1] never did" in msg
    with pytest.raises(TransferTimeoutError):
        peer.result(10)


def test_same_rank_twice_is_an_error() -> None:
    port = free_port()
    master = host_store("127.0.0.1", port, 3, 10)
    first = BackgroundCall(_join, connect_store("127.0.0.1", port, 10), 1, 3, port, 1.0)
    time.sleep(0.2)
    with pytest.raises(TransferError, match="rank 1 joined .* twice"):
        _join(connect_store("127.0.0.1", port, 10), 1, 3, port, 1.0)
    with pytest.raises(TransferTimeoutError):
        first.result(10)
    del master


def test_worker_cannot_reach_a_missing_store() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=f"127.0.0.1:{port}"):
        connect_store("127.0.0.1", port, 1.0)
    assert time.monotonic() - t0 < 10


class _GatedSource(WeightSource):
    """Holds iteration until ``gate`` is set, so the worker sits in a blocked receive."""

    def __init__(self, inner: TensorSource, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def metadata(self):  # type: ignore[no-untyped-def]
        return self.inner.metadata()

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.gate.wait(30)
        return iter(self.inner)


def test_shutdown_unblocks_a_worker_waiting_in_a_receive() -> None:
    state = {"a.w": torch.randn(64), "b.w": torch.randn(8).to(torch.bfloat16)}
    worker = WeightSyncWorker("nccl", ModuleSink(build_module(zeros_like_state(state))))
    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=2, timeout_s=20, rank=0
    )
    client = InProcessClient(worker, timeout_s=20)
    gate = threading.Event()
    with WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer:
        send = BackgroundCall(trainer.send_weights, _GatedSource(TensorSource(state), gate))
        deadline = time.monotonic() + 10
        while worker.weight_info()["busy"] != "update_weights":
            assert time.monotonic() < deadline, "the worker never entered update_weights"
            time.sleep(0.01)
        t0 = time.monotonic()
        worker.shutdown()
        deadline = time.monotonic() + 5
        while worker.weight_info()["busy"] is not None:
            assert time.monotonic() < deadline, "shutdown did not unblock the receive"
            time.sleep(0.01)
        assert time.monotonic() - t0 < 5
        assert "shut down" in (worker.weight_info()["last_error"] or "")
        gate.set()
        with pytest.raises(Exception, match="shut down|failed|closed"):
            send.result(30)


@pytest.mark.parametrize("peer", ["no store", "store, no trainer"])
def test_abort_preempts_a_worker_init_waiting_on_a_peer_that_never_answers(peer: str) -> None:
    """A restarted trainer's init must not wait out an init stuck on the old one (60 s here)."""
    worker = WeightSyncWorker("nccl", ModuleSink(build_module({"a.w": torch.zeros(4)})))
    port = free_port()
    store = host_store("127.0.0.1", port, 2, 60) if peer != "no store" else None
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
    if store is not None:
        init["secret"] = "ab" * 16  # the worker waits for a rank 0 that never arrives
    call = BackgroundCall(
        worker.init_weight_transfer_engine, {**init, "world_size": 2, "timeout_s": 60}
    )
    time.sleep(1.5)  # the worker is now waiting on its peer
    assert not call.done()
    t0 = time.monotonic()
    worker.engine.abort()
    with pytest.raises(TransferError, match="aborted"):
        call.result(30)
    # Far under the init's 60 s; an abort lands between store connection attempts of 1 s,
    # which ran past 3 s on a loaded CI host (3.06 s, without a store).
    assert time.monotonic() - t0 < 15
    del store
