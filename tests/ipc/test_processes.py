"""The ipc pair across real processes: a trainer and one or two worker processes."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch

from wtcore import ReceiverError, TensorSource
from wtcore.errors import TransferError, TransferTimeoutError

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


# ---------------------------------------------------------------------- happy paths
def test_rounds_bit_exact_two_workers(two_workers: list[Any], procs: Any) -> None:
    """Several rounds, many buckets, mixed dtypes and a tensor 5x larger than the buffer."""
    buffer = 16 << 10
    state = procs.make_state(1, big=20_000)  # 80 kB > 16 kB buffer: a bucket of its own
    for w in two_workers:
        w.setup(state)
    trainer, client = procs.trainer_for(two_workers, state, packed_buffer_size_bytes=buffer)
    try:
        segments = set()
        for step in range(3):
            procs.bump(state)
            stats = trainer.send_weights(weight_version=f"s{step}")
            segments.add(trainer.segment_name)
            assert stats.num_buckets > 10
            for w in two_workers:
                procs.assert_bit_exact(w.dump(), state)
                info = w.call("weight_info")
                assert info["weight_version"] == f"s{step}" and info["consistent"] is True
        assert len(segments) == 1, "the staging segment is created once and reused"
        updates = [p for c, p in client.calls if c == "update_weights"]
        assert len(updates) == 3, "one control call per round, whatever the number of buckets"
        assert {u["segment"] for u in updates} == segments
        for u in updates:
            json.dumps(u)  # plain JSON (RecordingClient checked the round trip too)
            assert len(u["names"]) == len(state) and u["num_slots"] == 4
            assert u["slot_bytes"] == buffer, "slots are the bucket size: big tensors stream"
        assert [u["seq"] for u in updates] == sorted({u["seq"] for u in updates})
        name = trainer.segment_name
        assert procs.reachable(name)
    finally:
        trainer.shutdown()
    assert not procs.reachable(name), "shutdown closes the segment"
    assert name not in procs.memfds_of(os.getpid()), "and unmaps it (the workers' maps keep it)"


def test_tensors_larger_than_a_slot_stream_through_a_fixed_ring(
    two_workers: list[Any], procs: Any
) -> None:
    """A tensor 3x the slot size travels in slot-sized chunks: the segment is sized by the
    bucket size and slot count only, never by the largest tensor, and is never replaced."""
    full = procs.make_state(2, big=200_000)  # 800 kB, slots of 256 KiB
    small = {k: v for k, v in full.items() if k != "huge.w"}
    for w in two_workers:
        w.setup(full)
    trainer, _ = procs.trainer_for(two_workers, small, packed_buffer_size_bytes=256 << 10)
    try:
        trainer.send_weights(weight_version="small")
        first = trainer.segment_name
        size = os.fstat(trainer._memory.fd).st_size
        assert size == 4096 + 4 * (64 + (256 << 10)), "control page + 4 slots, nothing more"
        trainer.send_weights(TensorSource(full), weight_version="full")
        assert trainer.segment_name == first, "a bigger tensor does not grow the ring"
        for w in two_workers:
            procs.assert_bit_exact(w.dump(), full)
            assert w.call("weight_info")["consistent"] is True
        procs.bump(full)
        trainer.send_weights(TensorSource(full), weight_version="full-again")
        for w in two_workers:
            procs.assert_bit_exact(w.dump(), full)
    finally:
        trainer.shutdown()
    assert not procs.reachable(first)


# ---------------------------------------------------------------------- bad payloads
BAD_PAYLOADS = {
    "missing_segment": (
        lambda u: {**u, "segment_fd": 1 << 30},
        "segment_fd: .* holds no descriptor",
    ),
    "other_segment": (
        lambda u: {**u, "segment": u["segment"][:-16] + "0123456789abcdef"},
        "not to the announced memfd",
    ),
    "fd_out_of_range": (lambda u: {**u, "segment_fd": -1}, "segment_fd: expected"),
    "fd_missing": (
        lambda u: {k: v for k, v in u.items() if k != "segment_fd"},
        "needs 'segment_fd'",
    ),
    "path_in_name": (
        lambda u: {**u, "segment": "../../etc/passwd"},
        "segment: expected a segment name",
    ),
    "num_slots_not_advertised": (lambda u: {**u, "num_slots": 3}, "num_slots: the trainer"),
    "slot_not_advertised": (lambda u: {**u, "slot_bytes": 64}, "slot_bytes: the trainer"),
    "slot_unaligned": (lambda u: {**u, "slot_bytes": u["slot_bytes"] + 1}, "slot_bytes: expected"),
    "slot_bytes_huge": (lambda u: {**u, "slot_bytes": 1 << 40}, "slot_bytes: the trainer"),
    "seq_huge": (lambda u: {**u, "seq": 1 << 63}, "seq: expected a number below"),
    "replayed_round": (lambda u: u, "cannot have stamped yet"),
}


@pytest.mark.parametrize("kind", sorted(BAD_PAYLOADS))
def test_bad_payload_applies_nothing(two_workers: list[Any], procs: Any, kind: str) -> None:
    """A bad round announcement is refused before anything is applied; the worker then takes
    the trainer's next round. ``replayed_round`` sends the last round's announcement again:
    its slots hold later buckets by now, which the worker refuses."""
    state = procs.make_state(3)
    trainer, last = procs.after_a_good_round(two_workers, state)
    try:
        mutate, message = BAD_PAYLOADS[kind]
        procs.refused_then_synced(two_workers, trainer, state, mutate(last), message)
    finally:
        trainer.shutdown()


FORGED = {
    "bad_magic": (lambda seg, seq, n: seg.publish(0, seq, n), b"EVILEVIL", "no valid magic"),
    "wrong_length": (lambda seg, seq, n: seg.publish(0, seq, n + 64), None, "the plan says"),
    "seq_ahead": (lambda seg, seq, n: seg.publish(0, seq + 1, n), None, "cannot have stamped"),
}


@pytest.mark.parametrize("kind", sorted(FORGED))
def test_forged_slot_header_is_refused_and_nothing_is_published(
    two_workers: list[Any], procs: Any, kind: str
) -> None:
    """The slot headers are hostile input: a forged one (bad magic, a length other than the
    plan's, a sequence number from the future) is an error naming the field; nothing of the
    bucket is applied, no version is published, and the next round is bit-exact."""
    state = procs.make_state(8)
    trainer, announce = procs.after_a_good_round(two_workers, state)
    try:
        seq = trainer._seq + 1
        trainer._seq += 2  # the trainer's next round stays clear of the forged number
        forge, magic, message = FORGED[kind]
        seg = trainer._memory
        nbytes = trainer.info.plan(TensorSource(state).metadata())[0].nbytes  # slot 0's bucket
        forge(seg, seq, nbytes)
        if magic is not None:
            at = seg.data_offset(0) - 64
            seg._mm[at : at + 8] = magic

        def heal() -> None:
            # The forger scribbled over the trainer's own memory. The trainer's next stamp of
            # slot 0 rewrites the header, but a worker may look at it first and (rightly) refuse
            # the garbage; put back a valid, older header as the trainer last left it.
            seg.publish(0, seq, nbytes)

        procs.refused_then_synced(
            two_workers, trainer, state, {**announce, "seq": seq}, message, heal
        )
    finally:
        trainer.shutdown()


# ---------------------------------------------------------------------- a worker dies or hangs
@pytest.mark.parametrize("flag", ["--die-at-update", "--hang-at-update"])  # the round's call
def test_worker_fails_mid_round_trainer_errors_and_cleans_up(procs: Any, flag: str) -> None:
    """A killed worker (EOF) or a hung one (timeout): the trainer raises within its timeout
    and unlinks its segment at once, before anyone calls shutdown."""
    state = procs.make_state(4)
    worker = procs.PipeWorker(flag, "1")
    held = procs.memfds_of(os.getpid())  # what earlier tests' garbage may still map
    timeout_s = 3.0
    trainer = None
    try:
        worker.setup(state)
        trainer, _ = procs.trainer_for(
            [worker], state, packed_buffer_size_bytes=2048, timeout_s=timeout_s
        )
        trainer.send_weights(weight_version="r1")  # many buckets: the trainer waits on the ring
    except (ReceiverError, TransferError, TransferTimeoutError) as e:
        first_error: BaseException | None = e
    else:
        first_error = None
    try:
        assert trainer is not None
        assert first_error is not None, "the worker failed in the first round"
        if flag == "--hang-at-update":
            assert isinstance(first_error, TransferTimeoutError)
        assert trainer.segment_name is None, "the segment was dropped on the error"
        assert procs.memfds_of(os.getpid()) <= held, "the trainer let go of its segment"
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


def test_worker_error_is_fast_and_bounded(procs: Any) -> None:
    """The hung worker's error arrives within the trainer's timeout (plus slack)."""
    state = procs.make_state(5)
    worker = procs.PipeWorker("--hang-at-update", "1")
    held = procs.memfds_of(os.getpid())  # what earlier tests' garbage may still map
    trainer = None
    try:
        worker.setup(state)
        trainer, _ = procs.trainer_for([worker], state, packed_buffer_size_bytes=2048, timeout_s=2)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="within 2 s"):
            trainer.send_weights(weight_version="v")
        assert time.monotonic() - t0 < 2 + 20  # never the client's 60 s
        assert procs.memfds_of(os.getpid()) <= held, "the trainer let go of its segment"
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


def test_a_worker_that_returned_first_and_died_fails_the_ring_at_once(procs: Any) -> None:
    """A worker returned from the ring's update and receives on a thread (vLLM's staged
    rounds), then its process dies mid-copy: no call of the round fails, yet the trainer
    names the rank at once (the kernel dropped its reader's lock), not at its 30 s timeout."""
    state = procs.make_state(6)
    worker = procs.PipeWorker("--returns-first-dies-at-tensor", "5")
    trainer = None
    try:
        worker.setup(state)
        trainer, _ = procs.trainer_for([worker], state, packed_buffer_size_bytes=2048, timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="rank 0 closed the ring or its process exited"):
            trainer.send_weights(weight_version="v")
        assert time.monotonic() - t0 < 15, "the trainer waited for its timeout"
        assert worker.proc.wait(10) == -9
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


# ---------------------------------------------------------------------- the trainer dies or exits
@pytest.mark.parametrize("then", ["late_update", "silence", "mid_stream"])
def test_trainer_killed_mid_round(two_workers: list[Any], procs: Any, then: str) -> None:
    """The trainer is SIGKILLed inside a round. ``mid_stream``: while the worker consumes its
    ring (some buckets applied): the worker notices within milliseconds (the trainer's lock is
    gone), fails naming the trainer, and survives. ``late_update``: after ``start``, before its
    round's announcement reached the worker, which the test then delivers: the orphaned segment
    is refused. ``silence``: nothing arrives any more and the round deadline abandons the round.
    Every way the orphaned segment is unlinked, the worker reports ``consistent: false``, and a
    new trainer's round is bit-exact."""
    state = procs.make_state(7)
    worker = two_workers[0]
    worker.world_size = 1
    try:
        worker.setup(state, round_timeout_s=1.0 if then == "silence" else 0)
        flags = ["--die-after-tensors", "40"] if then == "mid_stream" else []
        trainer = procs.TrainerProc("7", "4096", "1", *flags)
        try:
            announce = procs.relay_until_update(trainer, worker)
            segment = announce["segment"]
            assert procs.reachable(segment)
            before = worker.dump()
            if then != "mid_stream":
                trainer.proc.kill()  # SIGKILL: no atexit, no finalizer, nothing runs
                trainer.proc.wait(10)
            if then == "silence":
                deadline = time.monotonic() + 60
                while worker.call("weight_info")["state"] != "idle":
                    assert time.monotonic() < deadline, "the round deadline never fired"
                    time.sleep(0.1)
                assert "round deadline" in worker.call("weight_info")["last_error"]
            else:
                t0 = time.monotonic()
                with pytest.raises(
                    TransferError, match=r"trainer process that owned it \(trainer pid"
                ):
                    worker.call("update_weights", announce, timeout_s=60)
                if then == "mid_stream":
                    assert trainer.proc.wait(10) == -9
                    assert time.monotonic() - t0 < 20, "noticed long before any timeout"
            after = worker.dump()
            if then == "mid_stream":
                assert any(not torch.equal(after[n], before[n]) for n in before), "some applied"
            else:
                procs.assert_bit_exact(after, before)
            info = worker.call("weight_info")
            # silence: no update ever arrived, nothing was touched, so the model is still whole
            assert info["consistent"] is (then == "silence") and info["weight_version"] is None
            assert not procs.reachable(segment), "gone with its trainer"
            assert not procs.our_segments([trainer.proc.pid])
            # the worker survived: a new trainer's round is bit-exact
            procs.bump(state)
            fresh, _ = procs.trainer_for([worker], state, packed_buffer_size_bytes=4096)
            try:
                fresh.send_weights(weight_version="fresh")
            finally:
                fresh.shutdown()
            procs.assert_bit_exact(worker.dump(), state)
            info = worker.call("weight_info")
            assert info["consistent"] is True and info["weight_version"] == "fresh"
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
                    assert procs.reachable(msg["name"]), "alive and reused between rounds"
                    continue
                procs.relay(trainer, worker, msg)
            procs.assert_bit_exact(worker.dump(), state)
            trainer.answer({})  # go on: exit (with or without shutdown)
            assert trainer.proc.wait(30) == 0
            assert not procs.reachable(msg["name"])
            # The worker still maps it (it keeps its map between rounds) until it learns the
            # trainer is gone: an aborted round is where it looks.
            assert procs.our_segments([trainer.proc.pid]) == [msg["name"]]
            worker.call("start_weight_update")
            worker.call("abort")
            assert not procs.our_segments([trainer.proc.pid]), "the kernel freed it"
        finally:
            trainer.close()
    finally:
        worker.world_size = 2
