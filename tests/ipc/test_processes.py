"""The ipc pair across real processes: a trainer and one or two worker processes."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch

from wtcore import ReceiverError, TensorSource, WeightTransferTrainerFactory
from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing import RecordingClient
from wtcore_ipc import IPCTrainerInitInfo
from wtcore_ipc.shm import SHM_DIR

pytestmark = [pytest.mark.timeout(120)]


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t.contiguous()), f"{name}: values differ"


def bump(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.numel():
            t.add_(1)


def exists(name: str | None) -> bool:
    return name is not None and os.path.exists(os.path.join(SHM_DIR, name))


def trainer_for(workers: list[Any], procs: Any, state: Any, **kw: Any) -> tuple[Any, Any]:
    client = RecordingClient(procs.PipeClient(workers, timeout_s=60))
    info = IPCTrainerInitInfo(rank=0, **{"timeout_s": 30, **kw})
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    )
    return trainer, client


# ---------------------------------------------------------------------- happy paths
def test_rounds_bit_exact_two_workers(two_workers: list[Any], procs: Any) -> None:
    """Several rounds, many buckets, mixed dtypes and a tensor 5x larger than the buffer."""
    buffer = 16 << 10
    state = procs.make_state(1, big=20_000)  # 80 kB > 16 kB buffer: a bucket of its own
    for w in two_workers:
        w.setup(state)
    trainer, client = trainer_for(two_workers, procs, state, packed_buffer_size_bytes=buffer)
    try:
        segments = set()
        for step in range(3):
            bump(state)
            stats = trainer.send_weights(weight_version=f"s{step}")
            segments.add(trainer.segment_name)
            assert stats.num_buckets > 10
            for w in two_workers:
                assert_bit_exact(w.dump(), state)
                info = w.call("weight_info")
                assert info["weight_version"] == f"s{step}" and info["consistent"] is True
        assert len(segments) == 1, "the staging segment is created once and reused"
        updates = [p for c, p in client.calls if c == "update_weights"]
        assert max(u["length"] for u in updates) == 20_000 * 4
        assert {u["segment"] for u in updates} == segments
        # every payload is plain JSON (RecordingClient checked the round trip); offsets and
        # lengths stay inside one slot
        for u in updates:
            json.dumps(u)
            assert sum(u["sizes"]) <= u["length"]
        name = trainer.segment_name
        assert exists(name)
    finally:
        trainer.shutdown()
    assert not exists(name), "shutdown unlinks the segment"


def test_bigger_bucket_replaces_segment(two_workers: list[Any], procs: Any) -> None:
    full = procs.make_state(2, big=50_000)
    small = {k: v for k, v in full.items() if k != "huge.w"}
    for w in two_workers:
        w.setup(full)
    trainer, _ = trainer_for(two_workers, procs, small, packed_buffer_size_bytes=1 << 20)
    try:
        trainer.send_weights(weight_version="small")
        first = trainer.segment_name
        trainer.send_weights(TensorSource(full), weight_version="full")
        second = trainer.segment_name
        assert first != second and not exists(first) and exists(second)
        for w in two_workers:
            assert_bit_exact(w.dump(), full)
        trainer.send_weights(TensorSource(small), weight_version="small-again")
        assert trainer.segment_name == second, "a smaller round reuses the bigger segment"
    finally:
        trainer.shutdown()
    assert not exists(second)


# ---------------------------------------------------------------------- bad payloads
BAD_PAYLOADS = {
    "missing_segment": (
        lambda u: {**u, "segment": "wtcore_ipc_0_doesnotexist"},
        "no shared-memory segment",
    ),
    "path_in_name": (
        lambda u: {**u, "segment": "../../etc/passwd"},
        "segment: expected a segment name",
    ),
    "offset_not_a_slot": (lambda u: {**u, "offset": u["offset"] + 64}, "no staging slot starts"),
    "offset_outside": (lambda u: {**u, "offset": 1 << 40}, "outside segment"),
    "offset_unaligned": (lambda u: {**u, "offset": u["offset"] + 1}, "offset: expected a multiple"),
    "length_short": (
        lambda u: {**u, "length": u["length"] - 64},
        "length: the listed tensors occupy",
    ),
    "length_long": (
        lambda u: {**u, "length": u["length"] + 64},
        "length: the listed tensors occupy",
    ),
    "sizes_wrong": (lambda u: {**u, "sizes": [s + 1 for s in u["sizes"]]}, r"sizes\[0\]"),
    "stale_seq": (lambda u: {**u, "seq": u["seq"] - 1}, "stale or replayed"),
}


@pytest.mark.parametrize("kind", sorted(BAD_PAYLOADS))
def test_bad_payload_applies_nothing(two_workers: list[Any], procs: Any, kind: str) -> None:
    state = procs.make_state(3)
    worker = two_workers[0]
    for w in two_workers:
        w.setup(state)
    trainer, client = trainer_for(two_workers, procs, state, packed_buffer_size_bytes=4096)
    try:
        trainer.send_weights(weight_version="good")
        last = [p for c, p in client.calls if c == "update_weights"][-1]
        before = worker.dump()
        mutate, message = BAD_PAYLOADS[kind]
        worker.call("start_weight_update")
        with pytest.raises(ValueError, match=message):  # PayloadError is a ValueError
            worker.call("update_weights", mutate(last))
        assert_bit_exact(worker.dump(), before)
        worker.call("abort")
        info = worker.call("weight_info")
        assert info["weight_version"] == "good" and info["state"] == "idle"
        # the same, unmutated payload is still accepted: the check, not the worker, said no
        worker.call("start_weight_update")
        worker.call("update_weights", last)
        worker.call("finish_weight_update", "replayed")
        assert_bit_exact(worker.dump(), state)
    finally:
        trainer.shutdown()


# ---------------------------------------------------------------------- a worker dies or hangs
@pytest.mark.parametrize("flag", ["--die-at-update", "--hang-at-update"])
def test_worker_fails_mid_round_trainer_errors_and_cleans_up(procs: Any, flag: str) -> None:
    """A killed worker (EOF) or a hung one (timeout): the trainer raises within its timeout
    and unlinks its segment at once, before anyone calls shutdown."""
    state = procs.make_state(4)
    worker = procs.PipeWorker(flag, "3")
    timeout_s = 3.0
    trainer = None
    try:
        worker.setup(state)
        trainer, _ = trainer_for(
            [worker], procs, state, packed_buffer_size_bytes=2048, timeout_s=timeout_s
        )
        trainer.send_weights(weight_version="r1")  # more than 3 buckets: fails at update 3
    except (ReceiverError, TransferError, TransferTimeoutError) as e:
        first_error: BaseException | None = e
    else:
        first_error = None
    try:
        assert trainer is not None
        assert first_error is not None, "the worker failed at update 3 of the first round"
        if flag == "--hang-at-update":
            assert isinstance(first_error, TransferTimeoutError)
        assert trainer.segment_name is None, "the segment was dropped on the error"
        assert not procs.our_segments([os.getpid()])
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


def test_worker_error_is_fast_and_bounded(procs: Any) -> None:
    """The hung worker's error arrives within the trainer's timeout (plus slack)."""
    state = procs.make_state(5)
    worker = procs.PipeWorker("--hang-at-update", "2")
    trainer = None
    try:
        worker.setup(state)
        trainer, _ = trainer_for([worker], procs, state, packed_buffer_size_bytes=2048, timeout_s=2)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="did not return within 2 s"):
            trainer.send_weights(weight_version="v")
        assert time.monotonic() - t0 < 2 + 20  # never the client's 60 s
        assert not procs.our_segments([os.getpid()])
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


# ---------------------------------------------------------------------- the trainer dies or exits
@pytest.mark.parametrize("then", ["late_update", "silence"])
def test_trainer_killed_mid_round(two_workers: list[Any], procs: Any, then: str) -> None:
    """The trainer is SIGKILLed between two updates. Either its last announced update still
    arrives (the worker sees the orphaned segment), or nothing arrives any more and the
    round's deadline abandons the round; both ways the orphaned segment is unlinked."""
    state = procs.make_state(7)
    worker = two_workers[0]
    worker.world_size = 1
    try:
        worker.setup(state, round_timeout_s=1.0 if then == "silence" else 0)
        trainer = procs.TrainerProc("7", "4096", "1")
        try:
            updates = 0
            while True:
                msg = trainer.next_message()
                if msg["call"] == "update_weights":
                    updates += 1
                    if updates == 3:
                        break
                procs.relay(trainer, worker, msg)
            segment = msg["args"][0]["segment"]
            assert exists(segment)
            before = worker.dump()
            trainer.proc.kill()  # SIGKILL: no atexit, no finalizer, nothing runs
            trainer.proc.wait(10)
            if then == "late_update":
                with pytest.raises(TransferError, match="trainer process that owned it has exited"):
                    worker.call("update_weights", msg["args"][0])
            else:
                deadline = time.monotonic() + 60
                while worker.call("weight_info")["state"] != "idle":
                    assert time.monotonic() < deadline, "the round deadline never fired"
                    time.sleep(0.1)
                assert "round deadline" in worker.call("weight_info")["last_error"]
            assert_bit_exact(worker.dump(), before)
            info = worker.call("weight_info")
            assert info["consistent"] is False and info["weight_version"] is None
            assert not exists(segment), "the worker unlinked the orphaned segment"
            worker.call("shutdown")
            assert not procs.our_segments([trainer.proc.pid])
        finally:
            trainer.close()
    finally:
        worker.world_size = 2


@pytest.mark.parametrize("shutdown", [True, False], ids=["shutdown", "exit_without_shutdown"])
def test_trainer_process_exit_unlinks(two_workers: list[Any], procs: Any, shutdown: bool) -> None:
    state = procs.make_state(7)
    worker = two_workers[0]
    worker.world_size = 1
    try:
        worker.setup(state)
        args = ["7", "4096", "2"] + ([] if shutdown else ["--no-shutdown"])
        trainer = procs.TrainerProc(*args)
        try:
            rounds = 0
            while rounds < 2:
                msg = trainer.next_message()
                if msg.get("event") == "segment":
                    rounds += 1
                    assert exists(msg["name"]), "alive and reused between rounds"
                    continue
                procs.relay(trainer, worker, msg)
            assert_bit_exact(worker.dump(), state)
            trainer.answer({})  # go on: exit (with or without shutdown)
            assert trainer.proc.wait(30) == 0
            assert not exists(msg["name"])
            assert not procs.our_segments([trainer.proc.pid])
        finally:
            trainer.close()
    finally:
        worker.world_size = 2
