"""Round ownership and honest state (issue 13 items 4-8, and init preemption).

Real workers with the ``inline`` engine, real trainer engines and in-process clients; the
interleavings a second trainer could produce are driven from hooks in the first trainer's
client, so every step lands exactly where the issue says it does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from wtcore import (
    ModuleSink,
    ProtocolStateError,
    ReceiverError,
    TensorSource,
    VerificationError,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.errors import PayloadError
from wtcore.rounds import ROUND_KEY, new_round_id, stamp_round
from wtcore.testing import build_module, synthetic_state, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore.testing.recording import RecordingClient
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient

BUCKET = 4096


def _state(seed: int) -> dict[str, torch.Tensor]:
    return synthetic_state(32 << 10, 12, "float32", seed=seed)


class HookedClient(InProcessClient):
    """An in-process client that runs a hook just before finish, or after checksums."""

    before_finish: Callable[[], None] | None = None
    after_checksums: Callable[[], None] | None = None

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        hook, self.before_finish = self.before_finish, None
        if hook is not None:
            hook()
        super().finish_weight_update(weight_version)

    def checksums(self) -> list[dict[str, str]]:
        out = super().checksums()
        hook, self.after_checksums = self.after_checksums, None
        if hook is not None:
            hook()
        return out


def _trainer(client: Any) -> Any:
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=BUCKET)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


def _payloads(state: dict[str, torch.Tensor]) -> list[Any]:
    """The real ``update_weights`` payloads an inline trainer sends for ``state``."""
    rec = RecordingClient()
    _trainer(rec).send_weights(TensorSource(state), weight_version="recorded")
    return [p for c, p in rec.calls if c == "update_weights"]


def _worker(**kw: Any) -> tuple[WeightSyncWorker, torch.nn.Module]:
    model = build_module(zeros_like_state(_state(0)))
    return WeightSyncWorker("inline", ModuleSink(model), **kw), model


def _info(worker: WeightSyncWorker) -> tuple[Any, ...]:
    i = worker.weight_info()
    return i["weight_version"], i["consistent"], i["state"]


# ---------------------------------------------------------------------- item 4
def test_second_trainer_cannot_finish_or_update_a_round_it_does_not_own() -> None:
    """A starts and updates; B inits, starts, updates; A's finish is refused, then B's round
    publishes exactly B's weights. Nothing mixed is ever published as consistent."""
    worker, model = _worker()
    a_client, b_client = HookedClient(worker), HookedClient(worker)
    a, b = _trainer(a_client), _trainer(b_client)
    a.send_weights(TensorSource(_state(1)), weight_version="a1")
    seen: dict[str, Any] = {}

    def a_finish_inside_b_round() -> None:
        with pytest.raises(ReceiverError) as err:
            a_client.finish_weight_update("a-late")
        seen["a_finish"] = err.value
        seen["during_b"] = _info(worker)

    def b_round_inside_a_round() -> None:
        b.needs_handshake = True  # B inits (abandoning A's open round), starts, updates
        b_client.before_finish = a_finish_inside_b_round
        b.send_weights(TensorSource(_state(3)), weight_version="b")

    a_client.before_finish = b_round_inside_a_round
    with pytest.raises(ReceiverError) as a_err:
        a.send_weights(TensorSource(_state(2)), weight_version="a2")
    # A's finish, inside B's round: refused, 409, naming the conflict.
    err = seen["a_finish"]
    assert err.failures[0].status == 409
    assert "round is no longer open" in str(err) and "abandoned by a new init" in str(err)
    assert seen["during_b"] == ("a1", False, "updating")
    # A's own finish after B's round: refused as well (A's round is gone).
    assert a_err.value.failures[0].status == 409
    assert _info(worker) == ("b", True, "idle")
    assert_state_equal(model, _state(3))


def test_bare_update_inside_an_owned_round_is_refused_and_applies_nothing() -> None:
    worker, model = _worker()
    a_id = new_round_id()
    worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET})
    worker.start_weight_update(round_id=a_id)
    stranger = _payloads(_state(5))[0]
    for round_id in (None, new_round_id()):
        with pytest.raises(ProtocolStateError, match="belongs to another trainer"):
            worker.update_weights(stranger, round_id=round_id)
    assert_state_equal(model, zeros_like_state(_state(0)))  # nothing was applied
    assert _info(worker) == (None, True, "updating")
    for payload in _payloads(_state(6)):  # the owner carries on
        worker.update_weights(payload, round_id=a_id)
    worker.finish_weight_update("a", round_id=a_id)
    assert _info(worker) == ("a", True, "idle")
    assert_state_equal(model, _state(6))


def test_unowned_round_for_vllm_style_clients() -> None:
    """A start without an id (a client that speaks only vLLM's routes) opens an unowned
    round: it accepts calls without an id and refuses calls that carry one."""
    worker, model = _worker()
    worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET})
    worker.start_weight_update()
    payloads = _payloads(_state(7))
    with pytest.raises(ProtocolStateError, match="started without a round id"):
        worker.update_weights(payloads[0], round_id=new_round_id())
    for p in payloads:
        worker.update_weights(p)
    worker.finish_weight_update("legacy")
    assert _info(worker) == ("legacy", True, "idle")
    assert_state_equal(model, _state(7))


def test_malformed_round_id_is_a_payload_error() -> None:
    worker, _ = _worker()
    worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET})
    for bad in ("short", "x" * 129, "a b" * 10, 12345):
        with pytest.raises(ValueError, match="round_id"):
            worker.start_weight_update(round_id=bad)  # type: ignore[arg-type]
    assert worker.state.value == "idle"


# ---------------------------------------------------------------------- item 5
@pytest.mark.parametrize("intruder", ["bare update", "init, start, update"])
def test_update_between_checksums_and_finish_is_never_published_as_verified(
    intruder: str,
) -> None:
    worker, model = _worker()
    a_client, b_client = HookedClient(worker), InProcessClient(worker)
    a = _trainer(a_client)
    b_state = _state(9)

    def intrude() -> None:
        payloads = _payloads(b_state)
        if intruder == "bare update":
            with pytest.raises(ProtocolStateError, match="belongs to another trainer"):
                worker.update_weights(payloads[0])
        else:
            _trainer(b_client)
            b_client.start_weight_update()
            for p in payloads:
                b_client.update_weights(p)

    a_client.after_checksums = intrude
    if intruder == "bare update":
        # Refused: A's verified round finishes over exactly A's weights.
        a.send_weights(TensorSource(_state(8)), weight_version="a", verify=True)
        assert _info(worker) == ("a", True, "idle")
        assert_state_equal(model, _state(8))
    else:
        with pytest.raises(ReceiverError, match="round is no longer open") as err:
            a.send_weights(TensorSource(_state(8)), weight_version="a", verify=True)
        assert err.value.failures[0].status == 409
        assert _info(worker) == (None, False, "updating")  # B's round, not published
        b_client.finish_weight_update("b")
        assert _info(worker) == ("b", True, "idle")
        assert_state_equal(model, b_state)


# ---------------------------------------------------------------------- item 6
def test_an_open_round_is_abandoned_after_its_deadline() -> None:
    """A trainer that stops between two updates (killed) cannot leave the receiver
    ``updating`` forever: after ``round_timeout_s`` without a call the round is abandoned by
    a timer (no call needed), reported inconsistent, and a new trainer takes over."""
    worker, model = _worker(round_timeout_s=0.5)
    client = InProcessClient(worker)
    _trainer(client)
    client.start_weight_update()
    client.update_weights(_payloads(_state(10))[0])
    assert _info(worker) == (None, False, "updating")
    deadline = time.monotonic() + 30
    while worker.state.value != "idle":  # the state property never triggers the check
        assert time.monotonic() < deadline, "the round deadline never fired"
        time.sleep(0.05)
    info = worker.weight_info()
    assert (info["consistent"], info["rounds_failed"]) == (False, 1)
    assert "round deadline" in info["last_error"] and "round_timeout_s" in info["last_error"]
    with pytest.raises(ReceiverError, match="no longer open"):
        client.update_weights(_payloads(_state(10))[1])
    _trainer(InProcessClient(worker)).send_weights(TensorSource(_state(11)), weight_version="n")
    assert _info(worker) == ("n", True, "idle")
    assert_state_equal(model, _state(11))


def test_round_deadline_is_checked_lazily_and_is_per_idle_period() -> None:
    worker, _ = _worker(round_timeout_s=0.6)
    client = InProcessClient(worker)
    _trainer(client)
    client.start_weight_update()
    for p in _payloads(_state(12)):  # each call restarts the idle deadline
        time.sleep(0.2)
        client.update_weights(p)
    client.finish_weight_update("slow-but-alive")
    assert _info(worker) == ("slow-but-alive", True, "idle")
    with pytest.raises(ValueError, match="round_timeout_s"):
        _worker(round_timeout_s=0)


# ---------------------------------------------------------------------- item 7
class _CorruptingSink(ModuleSink):
    """Flips one value after loading: a silent data-plane bug."""

    def load_weights(self, weights: Any) -> None:
        batch = list(weights)
        super().load_weights(batch)
        with torch.no_grad():
            self._targets[batch[0][0]].view(-1)[:1].add_(1)


def test_verification_error_aborts_the_round_on_every_receiver() -> None:
    good_model = build_module(zeros_like_state(_state(0)))
    bad_model = build_module(zeros_like_state(_state(0)))
    good = WeightSyncWorker("inline", ModuleSink(good_model))
    bad = WeightSyncWorker("inline", _CorruptingSink(bad_model))
    client = InProcessClient([good, bad])
    trainer = _trainer(client)
    with pytest.raises(VerificationError):
        trainer.send_weights(TensorSource(_state(13)), weight_version="v", verify=True)
    for w in (good, bad):
        info = w.weight_info()
        assert info["state"] == "idle" and info["weight_version"] is None
        assert "abort_weight_update" in info["last_error"]
        assert "VerificationError" in info["last_error"]
        assert info["consistent"] is False  # the round's bytes are in: said so
    assert client.round_id is None
    trainer.send_weights(TensorSource(_state(14)), weight_version="w")  # recovers
    assert _info(good) == ("w", True, "idle")


# ---------------------------------------------------------------------- item 8
def test_a_round_without_updates_publishes_nothing() -> None:
    worker, _ = _worker()
    client = InProcessClient(worker)
    _trainer(client).send_weights(TensorSource(_state(15)), weight_version="v1")
    client.start_weight_update()
    with pytest.raises(ReceiverError, match="applied no update_weights") as err:
        client.finish_weight_update("v2")
    assert err.value.failures[0].status == 409
    assert _info(worker) == ("v1", True, "updating")  # still open, nothing published
    client.abort_weight_update("empty round")
    assert _info(worker) == ("v1", True, "idle")  # nothing was applied: still consistent


# ---------------------------------------------------------------------- preemption
class _BlockingSink(ModuleSink):
    """Blocks in ``load_weights`` until released (a call stuck on a dead trainer)."""

    def __init__(self, module: torch.nn.Module, *, fail: bool) -> None:
        super().__init__(module)
        self.entered, self.release, self.fail = threading.Event(), threading.Event(), fail
        self.block = True

    def load_weights(self, weights: Any) -> None:
        if self.block:
            self.block = False
            self.entered.set()
            assert self.release.wait(60)
            if self.fail:
                raise ConnectionError("peer gone")
        super().load_weights(weights)


@pytest.mark.parametrize("fail", [True, False], ids=["call-fails", "call-completes-late"])
def test_init_preempts_a_blocked_update(fail: bool) -> None:
    """An init arriving while an update is blocked calls the engine's ``abort()`` and takes
    over; the preempted call, whether it then fails or completes, publishes nothing."""
    model = build_module(zeros_like_state(_state(0)))
    sink = _BlockingSink(model, fail=fail)
    worker = WeightSyncWorker("inline", sink, preempt_timeout_s=30)
    worker.engine.abort = sink.release.set  # type: ignore[method-assign]
    a_client = InProcessClient(worker)
    a = _trainer(a_client)
    outcome: dict[str, BaseException] = {}

    def run_a() -> None:
        try:
            a.send_weights(TensorSource(_state(16)), weight_version="a")
        except BaseException as e:
            outcome["a"] = e

    t = threading.Thread(target=run_a)
    t.start()
    assert sink.entered.wait(60)
    assert worker.weight_info()["busy"] == "update_weights"
    b = _trainer(InProcessClient(worker))  # preempts A's blocked update
    t.join(60)
    assert not t.is_alive()
    assert isinstance(outcome.get("a"), ReceiverError)
    assert "preempted" in str(outcome["a"]) or "peer gone" in str(outcome["a"])
    info = worker.weight_info()
    assert (info["weight_version"], info["consistent"], info["state"]) == (None, False, "idle")
    b.send_weights(TensorSource(_state(17)), weight_version="b")
    assert _info(worker) == ("b", True, "idle")
    assert_state_equal(model, _state(17))


def test_preemption_that_does_not_end_in_time_is_a_timeout() -> None:
    model = build_module(zeros_like_state(_state(0)))
    sink = _BlockingSink(model, fail=True)
    worker = WeightSyncWorker("inline", sink, preempt_timeout_s=0.3)  # abort() does nothing
    client = InProcessClient(worker)
    _trainer(client)
    client.start_weight_update()
    payload = _payloads(_state(18))[0]
    errors: list[BaseException] = []

    def update() -> None:
        try:
            client.update_weights(payload)
        except ReceiverError as e:
            errors.append(e)

    t = threading.Thread(target=update)
    t.start()
    assert sink.entered.wait(60)
    with pytest.raises(TimeoutError, match="preempt_timeout_s"):
        worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET})
    assert "preempted, still ending" in worker.weight_info()["busy"]
    sink.release.set()
    t.join(60)
    assert "preempted" in str(errors[0])  # the late call failed and changed nothing
    info = worker.weight_info()
    assert (info["busy"], info["state"], info["consistent"]) == (None, "idle", False)
    worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET})  # now it can


# ------------------------------------------------------------- issue 29, items 8 and 9
def test_a_round_id_with_a_trailing_newline_is_refused() -> None:
    """``re.match`` with ``$`` let ``id + "\\n"`` through; ids are matched whole."""
    from wtcore.errors import PayloadError
    from wtcore.rounds import check_round_id

    rid = new_round_id()
    assert check_round_id(rid) == rid
    worker, _ = _worker()
    worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET, "packed": True})
    for bad in (rid + "\n", rid + "\r\n", "\n" + rid, rid + " "):
        with pytest.raises(PayloadError, match="round_id: expected"):
            check_round_id(bad)
        with pytest.raises(PayloadError, match="round_id: expected"):
            worker.start_weight_update(round_id=bad)
    assert _info(worker) == (None, True, "idle")
    worker.shutdown()


def test_every_transport_bounds_the_published_version_in_the_core() -> None:
    """The worker itself refuses a version over 256 characters (HTTP did; in process and the
    Ray actor, which delegate to it, published 10 MB): nothing published, the round open."""
    from wtcore.errors import PayloadError
    from wtcore.rounds import MAX_VERSION_CHARS

    state = _state(1)
    worker, model = _worker()
    client = InProcessClient([worker])
    trainer = _trainer(client)
    trainer.send_weights(TensorSource(state), weight_version="v" * MAX_VERSION_CHARS)
    assert _info(worker) == ("v" * MAX_VERSION_CHARS, True, "idle")
    worker.start_weight_update()
    for payload in _payloads(_state(2)):
        worker.update_weights(payload)
    with pytest.raises(
        PayloadError, match=r"weight_version: 10000000 characters, over the limit of 256"
    ):
        worker.finish_weight_update("x" * 10_000_000)
    version, consistent, st = _info(worker)
    assert version == "v" * MAX_VERSION_CHARS and consistent is False and st == "updating"
    worker.finish_weight_update("ok")  # the same round, a sane version
    assert _info(worker) == ("ok", True, "idle")
    assert_state_equal(model, _state(2))
    trainer.shutdown()
    worker.shutdown()


# ---------------------------------------------------------------------- the stamp in update_info
def test_a_round_id_stamped_into_update_info_stands_for_the_header() -> None:
    """Inside vLLM the header is dropped; the id a trainer stamps into every update is
    checked instead, and must agree with the header where there is one."""
    worker, model = _worker()
    a_id = new_round_id()
    worker.init_weight_transfer_engine({"packed_buffer_size_bytes": BUCKET})
    worker.start_weight_update(round_id=a_id)
    stranger = _payloads(_state(5))[0]
    with pytest.raises(ProtocolStateError, match="belongs to another trainer"):
        worker.update_weights(stamp_round(stranger, new_round_id()))
    with pytest.raises(ProtocolStateError, match=f"update_info.{ROUND_KEY} is not the call's"):
        worker.update_weights(stamp_round(stranger, new_round_id()), round_id=a_id)
    with pytest.raises(PayloadError, match=f"update_info.{ROUND_KEY}: expected"):
        worker.update_weights({**stranger, ROUND_KEY: "short"}, round_id=a_id)
    assert_state_equal(model, zeros_like_state(_state(0)))  # nothing was applied
    for payload in _payloads(_state(6)):  # no header: the stamp is the owner's id
        worker.update_weights(stamp_round(payload, a_id))
    worker.finish_weight_update("a", round_id=a_id)
    assert _info(worker) == ("a", True, "idle")
    assert_state_equal(model, _state(6))


def test_the_trainer_stamps_its_round_id_into_every_update() -> None:
    seen: list[tuple[Any, str | None]] = []

    class Watching(InProcessClient):
        def update_weights(self, update_info: Any) -> None:
            seen.append((update_info, self.round_id))
            super().update_weights(update_info)

    worker, model = _worker()
    _trainer(Watching(worker)).send_weights(TensorSource(_state(7)), weight_version="s")
    assert len(seen) > 1 and all(p[ROUND_KEY] == rid is not None for p, rid in seen)
    assert len({rid for _, rid in seen}) == 1
    assert_state_equal(model, _state(7))
    # A client without round ids (a plain recording one) gets update_info unchanged.
    assert all(ROUND_KEY not in p for p in _payloads(_state(7)))
