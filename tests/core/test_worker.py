"""The receiver state machine: exact errors, versions, consistency, concurrency."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from wtcore import (
    ModuleSink,
    PayloadError,
    ProtocolStateError,
    TensorSource,
    WeightSyncClient,
    WeightSyncWorker,
)
from wtcore.digest import digest_named
from wtcore.meta import metas_to_wire
from wtcore.testing import build_module
from wtcore.worker import WorkerState


def _payload(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A ``inline`` update carrying ``state`` in one bucket."""
    import base64

    from wtcore.buckets import pack_bucket, plan_buckets

    metas = TensorSource(state).metadata()
    [bucket] = plan_buckets(metas, 1 << 20)
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, [state[m.name] for m in metas], buf)
    return {**metas_to_wire(metas), "data": base64.b64encode(buf.numpy().tobytes()).decode()}


@pytest.fixture
def model() -> torch.nn.Module:
    return build_module({"a.w": torch.zeros(4), "b.w": torch.zeros(2, 2)})


@pytest.fixture
def worker(model: torch.nn.Module) -> WeightSyncWorker:
    w = WeightSyncWorker("inline", ModuleSink(model))
    yield w
    w.shutdown()


def _init(w: WeightSyncWorker) -> None:
    w.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 20})


def test_worker_is_a_client(worker: WeightSyncWorker) -> None:
    assert isinstance(worker, WeightSyncClient)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            "start_weight_update",
            "start_weight_update: not allowed in state 'uninitialized'; call init_weight_transfer_engine first",
        ),
        (
            "finish_weight_update",
            "finish_weight_update: not allowed in state 'uninitialized'; call start_weight_update first",
        ),
    ],
)
def test_calls_before_init(worker: WeightSyncWorker, call: str, message: str) -> None:
    with pytest.raises(ProtocolStateError) as exc:
        getattr(worker, call)()
    assert str(exc.value) == message


def test_update_before_init_and_before_start(worker: WeightSyncWorker) -> None:
    with pytest.raises(
        ProtocolStateError, match="update_weights: not allowed in state 'uninitialized'"
    ):
        worker.update_weights({})
    _init(worker)
    with pytest.raises(ProtocolStateError) as exc:
        worker.update_weights({})
    assert str(exc.value) == (
        "update_weights: not allowed in state 'idle'; call start_weight_update first"
    )


def test_start_twice_and_finish_without_start(worker: WeightSyncWorker) -> None:
    _init(worker)
    with pytest.raises(ProtocolStateError) as exc:
        worker.finish_weight_update("v")
    assert str(exc.value) == (
        "finish_weight_update: not allowed in state 'idle'; call start_weight_update first"
    )
    worker.start_weight_update()
    with pytest.raises(ProtocolStateError) as exc:
        worker.start_weight_update()
    assert str(exc.value) == (
        "start_weight_update: not allowed in state 'updating'; a round is already in progress "
        "(start was called twice?)"
    )


def test_version_published_only_after_finish(
    worker: WeightSyncWorker, model: torch.nn.Module
) -> None:
    _init(worker)
    new = {"a.w": torch.arange(4.0), "b.w": torch.ones(2, 2)}
    worker.start_weight_update()
    worker.update_weights(_payload(new))
    assert worker.weight_info()["weight_version"] is None
    assert worker.weight_info()["state"] == "updating"
    worker.finish_weight_update("step-1")
    info = worker.weight_info()
    assert (info["weight_version"], info["consistent"], info["state"]) == ("step-1", True, "idle")
    assert worker.checksums() == digest_named(new.items())


def test_bad_payload_applies_nothing_and_keeps_round_open(
    worker: WeightSyncWorker, model: torch.nn.Module
) -> None:
    _init(worker)
    before = digest_named(model.named_parameters())
    worker.start_weight_update()
    with pytest.raises(PayloadError, match="update_info.names: missing required field"):
        worker.update_weights({"dtype_names": [], "shapes": [], "data": ""})
    with pytest.raises(
        PayloadError,
        match=r"update_info: a list must hold one entry per worker rank, expected 1, got 2",
    ):
        worker.update_weights([{}, {}])
    assert digest_named(model.named_parameters()) == before
    assert worker.weight_info()["state"] == "updating"
    worker.update_weights(_payload({"a.w": torch.ones(4)}))  # the round goes on
    worker.finish_weight_update("ok")
    assert worker.weight_info()["weight_version"] == "ok"


def test_failed_round_reports_inconsistent_until_next_success(worker: WeightSyncWorker) -> None:
    _init(worker)
    worker.start_weight_update()
    worker.update_weights(_payload({"a.w": torch.ones(4)}))
    worker.finish_weight_update("v1")
    worker.start_weight_update()
    worker.update_weights(_payload({"a.w": torch.full((4,), 2.0)}))
    with pytest.raises(PayloadError, match="unknown parameter name"):
        worker.update_weights(_payload({"zzz": torch.ones(1)}))
    info = worker.weight_info()
    assert info["consistent"] is False
    assert info["weight_version"] == "v1"  # the last good version
    assert info["state"] == "idle" and "unknown parameter name" in info["last_error"]
    worker.start_weight_update()
    worker.update_weights(_payload({"a.w": torch.ones(4), "b.w": torch.ones(2, 2)}))
    worker.finish_weight_update("v2")
    assert worker.weight_info()["consistent"] is True


def test_reinit_abandons_an_open_round(worker: WeightSyncWorker) -> None:
    _init(worker)
    worker.start_weight_update()
    _init(worker)
    info = worker.weight_info()
    # A round that applied nothing changed nothing: still consistent.
    assert info["state"] == "idle" and info["consistent"] is True
    worker.start_weight_update()  # a fresh round works without restarting anything
    worker.update_weights(_payload({"a.w": torch.ones(4)}))
    _init(worker)
    info = worker.weight_info()
    assert info["state"] == "idle" and info["consistent"] is False


def test_list_update_picks_this_ranks_entry(model: torch.nn.Module) -> None:
    w = WeightSyncWorker("inline", ModuleSink(model), rank=1, world_size=2)
    try:
        _init(w)
        w.start_weight_update()
        w.update_weights([{"garbage": True}, _payload({"a.w": torch.full((4,), 5.0)})])
        w.finish_weight_update()
        assert torch.equal(dict(model.named_parameters())["a.w"], torch.full((4,), 5.0))
    finally:
        w.shutdown()


class _SlowSink(ModuleSink):
    def __init__(self, module: torch.nn.Module, gate: threading.Event) -> None:
        super().__init__(module)
        self.gate = gate

    def load_weights(self, weights: Any) -> None:
        assert self.gate.wait(10)
        super().load_weights(weights)


def _update_held_mid_load(w: WeightSyncWorker) -> threading.Thread:
    """Init, start, and an update on a thread, returned once it runs (its sink waits)."""
    _init(w)
    w.start_weight_update()
    t = threading.Thread(target=w.update_weights, args=(_payload({"a.w": torch.ones(4)}),))
    t.start()
    deadline = time.monotonic() + 5
    while w.weight_info()["busy"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return t


@pytest.mark.timeout(30)
def test_concurrent_call_rejected_and_info_never_blocks(model: torch.nn.Module) -> None:
    gate = threading.Event()
    w = WeightSyncWorker("inline", _SlowSink(model, gate))
    try:
        t = _update_held_mid_load(w)
        assert w.weight_info()["busy"] == "update_weights"
        with pytest.raises(
            ProtocolStateError,
            match="finish_weight_update: rejected, update_weights is still running",
        ):
            w.finish_weight_update()
        gate.set()
        t.join(10)
        w.finish_weight_update("v")
        assert w.weight_info()["weight_version"] == "v"
    finally:
        gate.set()
        w.shutdown()


@pytest.mark.timeout(30)
def test_an_abort_during_an_update_that_then_succeeds_still_ends_the_round(
    model: torch.nn.Module,
) -> None:
    """A trainer that abandons a round while a receiver's update is running (its bytes had
    all arrived, so the update then succeeds) must not leave that receiver in the round until
    its deadline: it ends the round as the call returns, inconsistent, naming the abort. (Over
    tcp's fan-out the fast receiver of a round another one failed was left ``updating`` with
    no error: the multi-node fault tests caught it.)"""
    gate = threading.Event()
    w = WeightSyncWorker("inline", _SlowSink(model, gate))
    try:
        t = _update_held_mid_load(w)
        w.abort_weight_update("the trainer's round failed on another receiver")
        assert w.weight_info()["state"] == "updating"  # the call is still running
        gate.set()
        t.join(10)
        info = w.weight_info()
        assert (info["state"], info["consistent"], info["busy"]) == ("idle", False, None)
        assert "the trainer's round failed on another receiver" in info["last_error"]
        with pytest.raises(ProtocolStateError):
            w.finish_weight_update("never")  # nothing of the abandoned round is published
        assert w.weight_info()["weight_version"] is None
    finally:
        gate.set()
        w.shutdown()


def test_shutdown_is_final_and_idempotent(worker: WeightSyncWorker) -> None:
    worker.shutdown()
    worker.shutdown()
    with pytest.raises(ProtocolStateError, match="state 'closed'"):
        _init(worker)


def test_bad_version_type(worker: WeightSyncWorker) -> None:
    _init(worker)
    worker.start_weight_update()
    with pytest.raises(PayloadError, match="weight_version: expected a string or null, got 5"):
        worker.finish_weight_update(5)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_shutdown_during_a_blocked_update_stays_closed(model: torch.nn.Module) -> None:
    gate = threading.Event()
    w = WeightSyncWorker("inline", _SlowSink(model, gate))
    _init(w)
    w.start_weight_update()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            w.update_weights(_payload({"zzz": torch.ones(1)}))  # will fail once released
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 5
    while w.weight_info()["busy"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    w.shutdown()
    gate.set()
    t.join(10)
    assert errors and w.state.value == "closed"
    assert w.weight_info()["consistent"] is False


def test_fan_out_fails_fast_once_a_receiver_failed() -> None:
    from wtcore import ReceiverError
    from wtcore_kit.fanout import fan_out

    release = threading.Event()

    def broken() -> None:
        raise PayloadError("bad payload")

    def stuck() -> None:
        release.wait(30)

    t0 = time.monotonic()
    try:
        with pytest.raises(ReceiverError) as exc:
            fan_out("update_weights", [("a", broken), ("b", stuck)], timeout_s=30, fail_fast_s=0.3)
    finally:
        release.set()
    assert time.monotonic() - t0 < 5
    text = str(exc.value)
    assert "a [400]: PayloadError: bad payload" in text
    assert "b: TransferTimeoutError: still running 0.3 s after a failed" in text


def test_fan_out_waits_for_everyone_when_nothing_failed() -> None:
    from wtcore_kit.fanout import fan_out

    assert fan_out(
        "x", [("a", lambda: 1), ("b", lambda: (time.sleep(0.2), 2)[1])], timeout_s=5
    ) == [1, 2]


def test_a_round_reads_inconsistent_from_its_first_update(worker: WeightSyncWorker) -> None:
    """Non-transactional: once a byte of a round may be applied, the model may be mixed."""
    _init(worker)
    worker.start_weight_update()
    assert worker.weight_info()["consistent"] is True  # nothing applied yet
    worker.update_weights(_payload({"a.w": torch.ones(4), "b.w": torch.ones(2, 2)}))
    assert worker.weight_info()["consistent"] is False
    worker.finish_weight_update("v1")
    assert (worker.weight_info()["consistent"], worker.weight_info()["weight_version"]) == (
        True,
        "v1",
    )


def test_init_mid_round_abandons_it_and_leaves_it_inconsistent(worker: WeightSyncWorker) -> None:
    _init(worker)
    worker.start_weight_update()
    worker.update_weights(_payload({"a.w": torch.ones(4), "b.w": torch.ones(2, 2)}))
    _init(worker)  # a trainer recovering from a failed round
    info = worker.weight_info()
    assert (info["state"], info["consistent"], info["weight_version"]) == ("idle", False, None)


def test_the_init_field_name_0_1_deprecated_is_refused(worker: WeightSyncWorker) -> None:
    """0.1.0 said ``buffer_size_bytes`` would go in the next release: refused, naming it."""
    with pytest.raises(PayloadError, match="buffer_size_bytes"):
        worker.init_weight_transfer_engine({"buffer_size_bytes": 1 << 20})
    assert worker.weight_info()["state"] == "uninitialized"


@pytest.mark.parametrize("backend", ["inline", "ipc", "nccl"])
def test_engine_without_init_is_the_same_protocol_error(backend: str) -> None:
    from wtcore import WeightTransferConfig, WeightTransferEngineFactory

    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend), sink=ModuleSink(build_module({"a.w": torch.zeros(1)}))
    )
    meta = {"names": ["a.w"], "dtype_names": ["float32"], "shapes": [[1]]}
    extra = {
        "inline": {"data": "AAAAAA=="},
        "ipc": {
            "seq": 1,
            "segment": "wtcore_ipc_123_0123456789abcdef",
            "segment_fd": 5,
            "num_slots": 4,
            "slot_bytes": 4096,
        },
        "nccl": {},
    }[backend]
    with pytest.raises(ProtocolStateError, match="init_transfer_engine was not called"):
        engine.start_weight_update()
        engine.update_weights({**meta, **extra})


@pytest.mark.timeout(60)
def test_an_init_preempting_a_transactional_commit_leaves_the_weights_inconsistent(
    model: torch.nn.Module,
) -> None:
    """Issue 29, item 4: an init that preempted a transactional finish while it committed
    rolled the (already copying) staging back and kept ``v1, consistent: true`` over v2's
    bytes. The commit is now known to the preemption: the old version, ``consistent: false``."""
    gate, entered = threading.Event(), threading.Event()

    class CommitGate(ModuleSink):
        """The real sink: its first load (the commit of the staged round) waits for the gate."""

        calls = 0

        def load_weights(self, weights: Any) -> None:
            self.calls += 1
            if self.calls == 2:  # call 1: round v1's commit; call 2: round v2's
                entered.set()
                assert gate.wait(30)
            super().load_weights(weights)

    w = WeightSyncWorker("inline", CommitGate(model), transactional=True)
    try:
        _init(w)
        for version, value in (("v1", 1.0), ("v2", 2.0)):
            w.start_weight_update()
            w.update_weights(_payload({"a.w": torch.full((4,), value)}))
            if version == "v1":
                w.finish_weight_update(version)
        assert w.weight_info()["weight_version"] == "v1"
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                w.finish_weight_update("v2")
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=finish)
        t.start()
        assert entered.wait(30), "the commit never started"
        init = threading.Thread(target=_init, args=(w,))
        init.start()
        deadline = time.monotonic() + 30
        while w.state is WorkerState.UPDATING and time.monotonic() < deadline:
            time.sleep(0.01)  # the init has preempted the round
        gate.set()  # the commit goes on writing v2 into the model
        t.join(30)
        init.join(30)
        assert not t.is_alive() and not init.is_alive()
        (error,) = errors
        assert isinstance(error, ProtocolStateError) and "preempted" in str(error)
        assert torch.equal(model.get_parameter("a.w"), torch.full((4,), 2.0))  # v2's bytes
        info = w.weight_info()
        assert info["weight_version"] == "v1" and info["consistent"] is False
    finally:
        gate.set()
        w.shutdown()
