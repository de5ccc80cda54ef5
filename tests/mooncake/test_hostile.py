"""Hostile and broken peers of the mooncake engine, against real transfer engines.

Every slot, length and region an update or an init names is checked against what the
handshake announced and what the metadata plans, before a byte moves; a trainer that is gone
or stalls fails the round within the timeout, naming its endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore.meta import ParamMeta, metas_to_wire
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore.testing.procs import freeze, stop_processes
from wtcore_kit.inproc import InProcessClient
from wtcore_mooncake import MooncakeTrainerInitInfo, te
from wtcore_mooncake.worker import MooncakeWorkerEngine

# Real transfer engines listening on ports, and rounds that stall on purpose until a timeout:
# not for make quick.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(64, 8, generator=g), "b": torch.randn(100, generator=g)}


def _synced_worker(
    state: dict[str, torch.Tensor] | None = None,
) -> tuple[WeightSyncWorker, Any, torch.nn.Module, dict[str, Any]]:
    """A worker after one real round of ``state`` (default :func:`_state`); returns it, the
    trainer, its model and the init it got."""
    state = _state() if state is None else state
    model = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    info = MooncakeTrainerInitInfo(packed_buffer_size_bytes=4096, timeout_s=30, rank=0)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=InProcessClient(worker, timeout_s=30), source=TensorSource(state)
    )
    trainer.send_weights(weight_version="v1")
    assert_state_equal(model, state)
    return worker, trainer, model, trainer.worker_init_info()


@pytest.mark.parametrize(
    ("forge", "fragment"),
    [
        ({"slot": 2}, "update_info.slot: 2, the init announced 2"),
        ({"slot": 64}, r"update_info.slot: expected an int in \[0, 64\)"),
        ({"nbytes": 1 << 20}, "update_info.nbytes: 1048576 bytes announced"),
        ({"nbytes": -1}, r"update_info.nbytes: expected an int"),
        ({"shapes": [[64, 8], [1000]]}, "update_info.nbytes: 2448 bytes announced"),
        # source reads: each region is exactly its tensor's bytes, one per tensor, no slot
        ({"regions": [[4096, 2047], [8192, 400]]}, r"regions\[0\]: 2047 bytes, 'a' has 2048"),
        ({"regions": [[4096, 2048]]}, r"expected one \[address, bytes\] per tensor \(2\)"),
        ({"regions": [[0, 2048], [8192, 400]]}, r"regions\[0\] address: expected an int"),
        ({"regions": [[4096, 2048], 7]}, r"regions\[1\]: expected \[address, bytes\]"),
        ({"regions": "everything"}, "update_info.regions"),
        ({"slot": 0, "regions": [[4096, 2048], [8192, 400]]}, "read from regions has no slot"),
    ],
)
def test_a_forged_update_is_refused_before_anything_moves(
    forge: dict[str, Any], fragment: str
) -> None:
    worker, trainer, model, _ = _synced_worker()
    try:
        metas = [ParamMeta("a", torch.float32, (64, 8)), ParamMeta("b", torch.float32, (100,))]
        good = {**metas_to_wire(metas), "slot": 0, "nbytes": 2448}
        if "regions" in forge:
            del good["slot"]
        worker.start_weight_update()
        with pytest.raises(PayloadError, match=fragment):
            worker.update_weights({**good, **forge})
        assert_state_equal(model, _state())  # nothing written
    finally:
        trainer.shutdown()
        worker.shutdown()


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("endpoint", "no-port", "init_info.endpoint: expected host:port"),
        ("endpoint", "127.0.0.1:70000", "init_info.endpoint: expected host:port"),
        ("slots", [], "init_info.slots: expected 1 to 64 regions"),
        ("slots", [[0, 4096]], r"init_info.slots\[0\] address"),
        ("slots", [[4096, 0]], r"init_info.slots\[0\] bytes"),
        ("slots", [[4096]], r"init_info.slots\[0\]: expected \[address, bytes\]"),
        ("protocol", "udp", "init_info.protocol"),
    ],
)
def test_a_bad_init_is_refused_naming_the_field(field: str, value: Any, fragment: str) -> None:
    worker, trainer, _model, init = _synced_worker()
    try:
        with pytest.raises(PayloadError, match=fragment):
            worker.init_weight_transfer_engine({**init, field: value})
    finally:
        trainer.shutdown()
        worker.shutdown()


STALLING_TRAINER = """
import json, sys, time, torch
from wtcore_mooncake import te
engine, endpoint = te.start("127.0.0.1", "tcp")
buf = torch.full((1 << 20,), int(sys.argv[1]), dtype=torch.uint8)
assert engine.register_memory(buf.data_ptr(), buf.numel()) == 0
print(json.dumps({"endpoint": endpoint, "address": buf.data_ptr()}), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def stalling_trainer(fill: int = 0) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """A trainer process whose transfer engine lends 1 MiB of ``fill`` bytes; yields it and
    its endpoint and buffer address, and stops it with SIGTERM (after a SIGCONT, in case it
    was stopped): it sleeps forever, so waiting for it to exit on its own cost 10 s a test."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLING_TRAINER, str(fill)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        yield proc, json.loads(proc.stdout.readline())
    finally:
        stop_processes([proc], 10, sig=signal.SIGTERM)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize(
    ("fault", "form"),
    [(f, w) for f in ("killed", "stopped") for w in ("slot", "regions")] + [("unlent", "regions")],
)
def test_a_trainer_that_dies_or_stalls_fails_the_round_in_time_naming_it(
    fault: str, form: str
) -> None:
    """A trainer process SIGKILLed, or SIGSTOPped, before the worker reads: the read fails, or
    is bounded by ``timeout_s``; the error names the trainer's endpoint either way. A region
    the trainer never registered (``unlent``: past its buffer) is refused by the trainer's
    transfer engine (a slot there is refused before, as in the forged updates above)."""
    worker = WeightSyncWorker("mooncake", ModuleSink(build_module({"w": torch.zeros(256)})))
    with stalling_trainer() as (proc, peer), contextlib.ExitStack() as done:
        done.callback(worker.shutdown)
        if fault == "killed":
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        elif fault == "stopped":
            freeze(proc.pid)
        worker.init_weight_transfer_engine(
            {
                "endpoint": peer["endpoint"],
                "slots": [[peer["address"], 1 << 20]],
                "packed_buffer_size_bytes": 1 << 20,
                "timeout_s": 3.0,
            }
        )
        worker.start_weight_update()
        address = peer["address"] + (1 << 20 if fault == "unlent" else 0)
        where = {"slot": 0} if form == "slot" else {"regions": [[address, 1024]]}
        update = {**metas_to_wire([ParamMeta("w", torch.float32, (256,))]), **where}
        t0 = time.monotonic()
        with pytest.raises((TransferTimeoutError, TransferError), match=peer["endpoint"]):
            worker.update_weights({**update, "nbytes": 1024})
        assert time.monotonic() - t0 < 30  # the timeout (3 s), with a wide margin
        assert worker.weight_info()["consistent"] is False  # failed, nothing published


def _init(peer: dict[str, Any]) -> dict[str, Any]:
    """The handshake of a :func:`stalling_trainer`: its 1 MiB buffer as the one slot."""
    return {
        "endpoint": peer["endpoint"],
        "slots": [[peer["address"], 1 << 20]],
        "packed_buffer_size_bytes": 1 << 20,
        "timeout_s": 3.0,
    }


def _read(peer: dict[str, Any], name: str, offset: int) -> dict[str, Any]:
    """An update reading 64 float32s, ``name``, from ``offset`` in the trainer's buffer."""
    return {
        **metas_to_wire([ParamMeta(name, torch.float32, (64,))]),
        "regions": [[peer["address"] + offset, 256]],
        "nbytes": 256,
    }


LANDED = torch.ones(256, dtype=torch.uint8).view(torch.float32)  # a stalling trainer's bytes


@contextlib.contextmanager
def stalled_in_place_read() -> Iterator[
    tuple[WeightSyncWorker, torch.nn.Module, subprocess.Popen[bytes], dict[str, Any]]
]:
    """A worker whose round's read into the model's own tensor ``w`` a SIGSTOPped
    :func:`stalling_trainer` stalled, failed by the worker's ``timeout_s``, and the trainer's
    next handshake; yields the worker, its model, the stopped trainer and its peer."""
    model = build_module({"a": torch.zeros(64), "w": torch.zeros(64)})
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    with stalling_trainer(fill=1) as (proc, peer), contextlib.ExitStack() as done:
        done.callback(worker.shutdown)
        worker.init_weight_transfer_engine(_init(peer))
        worker.start_weight_update()
        worker.update_weights(_read(peer, "a", 0))  # a round's first bucket goes through staging
        freeze(proc.pid)  # every thread stopped: none can still answer the read
        with pytest.raises(TransferTimeoutError, match=peer["endpoint"]):
            worker.update_weights(_read(peer, "w", 256))  # in place: the model's own tensor
        worker.init_weight_transfer_engine(_init(peer))  # the trainer's next handshake
        yield worker, model, proc, peer


def _round_after(worker: WeightSyncWorker, model: torch.nn.Module, peer: dict[str, Any]) -> None:
    """The rest of a started round that rewrites both tensors; published, bit-exact."""
    worker.update_weights(_read(peer, "a", 512))
    worker.update_weights(_read(peer, "w", 768))
    worker.finish_weight_update()
    assert torch.equal(model.w, LANDED)
    assert worker.weight_info()["consistent"] is True


def test_a_read_that_outlived_its_round_holds_back_the_next_until_it_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read into the model's own tensor, stalled by a SIGSTOPped trainer, times out and fails
    its round; Mooncake cannot cancel it, and (with the user's own 60 s bound on stalls, which
    the worker keeps) it lands once the trainer runs again. The next round cannot start while
    it may still land (it could do so over that round's bytes, after publication); once it
    has, the next round starts and rewrites the tensor."""
    monkeypatch.setenv(te.PROGRESS_ENV, "60")
    with stalled_in_place_read() as (worker, model, proc, peer):
        with pytest.raises(TransferTimeoutError, match="1 of the model's tensors"):
            worker.start_weight_update()
        assert worker.weight_info()["consistent"] is False
        os.kill(proc.pid, signal.SIGCONT)
        worker.start_weight_update()  # waits for the stale read, which now ends
        assert torch.equal(model.w, LANDED)  # it landed, before this round
        _round_after(worker, model, peer)
    assert os.environ[te.PROGRESS_ENV] == "60"  # the user's, kept


def test_a_stalled_read_ends_inside_mooncake_and_the_next_round_need_not_wait_for_it() -> None:
    """Without a bound of the user's, the worker bounds Mooncake's stalled TCP transfers by
    just over its ``timeout_s`` (Mooncake's own bound is 30 s): a read into the model's own
    tensor, stalled by a SIGSTOPped trainer, fails inside Mooncake a second after the worker
    gave up on it (and its start_weight_update waits for that second). The next round starts
    while that trainer is still stopped (before, it waited for the trainer to run again), and
    nothing of the stalled read lands after: the tensor keeps its old bytes until a round
    writes it."""
    with stalled_in_place_read() as (worker, model, proc, peer):
        assert os.environ[te.PROGRESS_ENV] == "4"  # just over the init's timeout_s, 3.0
        worker.start_weight_update()  # the stalled read has ended: nothing to wait for
        worker.abort_weight_update("the trainer is stopped")
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.0)  # what the stopped trainer had to send, it sends now
        assert torch.equal(model.w, torch.zeros(64)), "a read that had failed landed later"
        worker.start_weight_update()
        _round_after(worker, model, peer)


@pytest.mark.parametrize(
    ("timeout_s", "before", "after"),
    [(2.5, None, "3"), (3.0, None, "4"), (0.2, None, "1"), (300.0, None, "30"), (2.5, "45", "45")],
)
def test_the_bound_on_stalls_follows_timeout_s_unless_the_user_set_one(
    monkeypatch: pytest.MonkeyPatch, timeout_s: float, before: str | None, after: str
) -> None:
    """The next whole second over ``timeout_s``, at most Mooncake's own 30; a value the user
    set stays."""
    monkeypatch.delenv(te.PROGRESS_ENV, raising=False)
    if before is not None:
        monkeypatch.setenv(te.PROGRESS_ENV, before)
    te.bound_stalls(timeout_s)
    assert os.environ[te.PROGRESS_ENV] == after
    te.bound_stalls(4.0)  # a later init: the process's bound follows it, unless the user's
    assert os.environ[te.PROGRESS_ENV] == ("5" if before is None else before)


def test_a_round_that_did_not_finish_leaves_the_worker_a_fresh_transfer_engine() -> None:
    """A round that read and did not finish (here its trainer gave up after the first bucket)
    makes the worker close this process's transfer engine before its next round and start a
    fresh one, as the trainer does: after a round cut off mid-read, the next round once came
    out mixed on a surviving worker (tests/multinode/test_faults.py). A finished round keeps
    the engine (closing one costs about a second)."""
    model = build_module({"a": torch.zeros(64)})
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    with stalling_trainer(fill=1) as (_proc, peer), contextlib.ExitStack() as done:
        done.callback(worker.shutdown)
        worker.init_weight_transfer_engine(_init(peer))
        engine = worker.engine
        assert isinstance(engine, MooncakeWorkerEngine)
        worker.start_weight_update()
        worker.update_weights(_read(peer, "a", 0))
        worker.finish_weight_update()
        first = engine.endpoint
        worker.start_weight_update()  # after a finished round: the same transfer engine
        assert engine.endpoint == first
        worker.update_weights(_read(peer, "a", 256))
        worker.abort_weight_update("the trainer gave up")
        assert worker.weight_info()["consistent"] is False
        old = weakref.ref(engine._engine)
        worker.start_weight_update()  # closes it, and starts a fresh one
        assert engine.endpoint != first
        assert old() is None, "the failed round's transfer engine is still open"
        model.a.zero_()
        worker.update_weights(_read(peer, "a", 512))
        worker.finish_weight_update()
        assert torch.equal(model.a, LANDED)
        assert worker.weight_info()["consistent"] is True


#: A stranger: its own transfer engine writes ``n`` bytes of 0x55 at ``address`` of the engine
#: at ``endpoint`` (no handshake of wtcore's, no credentials); prints Mooncake's status.
STRANGER = """
import json, sys, torch
from mooncake.engine import TransferEngine
endpoint, address, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = torch.full((n,), 0x55, dtype=torch.uint8)
assert engine.register_memory(buf.data_ptr(), n) == 0
print(json.dumps({"rc": engine.transfer_sync_write(endpoint, buf.data_ptr(), address, n)}))
"""


def _stranger_writes(endpoint: str, address: int, n: int) -> int:
    """Run :data:`STRANGER` against ``endpoint``; Mooncake's status of its write (0: written)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STRANGER, endpoint, str(address), str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        stop_processes([proc], 5)
    return int(json.loads(out)["rc"])


def test_a_stranger_cannot_write_the_published_model_between_rounds() -> None:
    """A stranger's transfer engine writes into a tensor the last round read in place:
    Mooncake refuses it (the worker registered it only while its read ran), and the model,
    still reported ``consistent``, holds exactly the round's bytes."""
    state = {f"embed_tokens.{i}": t for i, t in enumerate(torch.randn(3, 1024).unbind())}
    worker, trainer, model, _ = _synced_worker(state)  # 3 buckets of 4 KiB: 2 read in place
    try:
        engine = worker.engine
        assert isinstance(engine, MooncakeWorkerEngine)
        assert engine.in_place_bytes >= 2 * 4096  # the last two, at least, read in place
        target = model.get_parameter("embed_tokens.2")
        rc = _stranger_writes(engine.endpoint, target.data_ptr(), 4096)
        assert rc != 0, "a stranger wrote into the published model"
        assert_state_equal(model, state)
        assert worker.weight_info()["consistent"] is True
    finally:
        trainer.shutdown()
        worker.shutdown()
