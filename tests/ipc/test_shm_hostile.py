"""Shared memory as hostile ground (issue 14, items 7-9): a small /dev/shm, a FIFO or a truncated
segment named by an update, a trainer killed before any worker mapped its segment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError, TransferError
from wtcore_ipc.shm import SHM_DIR, StagingSegment

pytestmark = [pytest.mark.timeout(120)]


# ---------------------------------------------------------------------- item 7: small /dev/shm
_SMALL_SHM_CHILD = textwrap.dedent(
    """
    import json, os, torch
    from wtcore import TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
    from wtcore_kit.inproc import InProcessClient
    from wtcore.sink import ModuleSink
    from wtcore.testing import build_module
    from wtcore_ipc import IPCTrainerInitInfo

    state = {"w": torch.arange(10 << 20, dtype=torch.float32)}  # 40 MiB; 2 slots: 128 MiB
    worker = WeightSyncWorker("ipc", ModuleSink(build_module({"w": torch.zeros(10 << 20)})))
    out = {"error": None}
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(
            rank=0, timeout_s=30, packed_buffer_size_bytes=64 << 20, packed_num_buffers=2
        ),
        client=InProcessClient([worker], timeout_s=30),
        source=TensorSource(state),
    )
    try:
        trainer.send_weights(weight_version="v1")
    except Exception as e:
        out["error"] = [type(e).__name__, str(e), [c.__name__ for c in type(e).__mro__]]
    out["left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("wtcore"))
    out["consistent"] = worker.weight_info()["consistent"]
    trainer.shutdown()
    worker.shutdown()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounting a 64 MiB tmpfs over /dev/shm in a private mount namespace needs root "
    "and unshare(1)",
)
def test_small_dev_shm_is_a_clear_error_and_leaves_nothing() -> None:
    """Docker's default 64 MiB /dev/shm, a 128 MiB staging segment: before, the trainer died of
    SIGBUS while packing and left the segment behind; now it is a WtcoreError naming the size
    and the fix, raised before anything is written, and /dev/shm is empty afterwards."""
    script = 'mount -t tmpfs -o size=64m wtcore-test /dev/shm && exec "$0" -c "$1"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, _SMALL_SHM_CHILD],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, f"rc={proc.returncode} (-7 is SIGBUS): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is not None, "the round cannot fit in 64 MiB"
    kind, message, mro = out["error"]
    assert "WtcoreError" in mro and kind == "TransferError"
    size = 4096 + 2 * (64 + (64 << 20))  # the control page, two slots of 64 MiB
    assert f"{size}-byte segment" in message
    assert "--shm-size" in message and "packed_buffer_size_bytes" in message
    assert out["left"] == [], "no segment is left in /dev/shm"
    assert out["consistent"] is True, "nothing reached the worker"


# ---------------------------------------------------------------------- item 8: FIFO, truncation
def test_an_update_naming_a_fifo_is_refused_at_once(procs: Any) -> None:
    """Before, the worker's open() blocked forever on the FIFO (no writer ever comes)."""
    state = procs.make_state(11)
    worker = procs.PipeWorker()
    fifo = Path(SHM_DIR) / f"wtcore_ipc_{os.getpid()}_fifo"
    trainer = None
    try:
        trainer, last = procs.after_a_good_round([worker], state)
        os.mkfifo(fifo, 0o600)
        before = worker.dump()
        worker.call("start_weight_update")
        with pytest.raises(PayloadError, match="not a regular shared-memory file"):
            worker.call("update_weights", {**last, "segment": fifo.name}, timeout_s=15)
        assert worker.proc.poll() is None
        procs.assert_bit_exact(worker.dump(), before)
        worker.call("abort")
        procs.bump(state)
        trainer.send_weights(weight_version="next")
        procs.assert_bit_exact(worker.dump(), state)
        assert worker.call("weight_info")["consistent"] is True
    finally:
        fifo.unlink(missing_ok=True)
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


def test_a_segment_truncated_under_the_mapping_is_an_error_not_sigbus(procs: Any) -> None:
    """Before, the next update touched pages past the new end of file: SIGBUS killed the worker."""
    state = procs.make_state(12)
    worker = procs.PipeWorker()
    trainer = None
    try:
        trainer, last = procs.after_a_good_round([worker], state)
        path = Path(SHM_DIR) / last["segment"]
        size = path.stat().st_size
        before = worker.dump()
        os.truncate(path, 0)
        try:
            worker.call("start_weight_update")
            with pytest.raises(TransferError, match="truncated to 0 bytes while mapped"):
                worker.call("update_weights", last, timeout_s=15)
            assert worker.proc.poll() is None, "the worker survived"
            procs.assert_bit_exact(worker.dump(), before)
            worker.call("abort")
        finally:
            os.truncate(path, size)  # the trainer's own mapping needs its pages back
        procs.bump(state)
        trainer.send_weights(weight_version="next")
        procs.assert_bit_exact(worker.dump(), state)
        info = worker.call("weight_info")
        assert info["consistent"] is True and info["weight_version"] == "next"
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


# ---------------------------------------------------------------------- item 9: early death
@pytest.mark.parametrize("reclaimer", ["worker_init", "new_segment"])
def test_trainer_killed_before_its_first_update_leaks_no_segment(
    two_workers: list[Any], procs: Any, reclaimer: str
) -> None:
    """The trainer staged its segment and was SIGKILLed before any worker mapped it: before,
    nobody ever unlinked it. Now the next worker init, or the next segment any trainer
    creates, reclaims it (its lock died with its owner)."""
    state = procs.make_state(13)
    worker = two_workers[0]
    worker.world_size = 1
    try:
        worker.setup(state)
        trainer = procs.TrainerProc("13", "4096", "1")
        try:
            msg = trainer.next_message()
            assert msg["call"] == "init_weight_transfer_engine"
            init = msg["args"][0]
            procs.relay(trainer, worker, msg)
            msg = trainer.next_message()
            assert msg["call"] == "start_weight_update"  # the segment is staged by now
            leaked = procs.our_segments([trainer.proc.pid])
            assert len(leaked) == 1
            trainer.proc.kill()
            trainer.proc.wait(10)
            # Nobody mapped it, so it is still there, unless another wtcore process on this
            # host created a segment meanwhile and reclaimed it first (the same mechanism):
            # what matters is that it is gone below.
            if reclaimer == "worker_init":
                worker.call("init_weight_transfer_engine", init)
            else:
                StagingSegment(4096, 1).close()
            assert procs.our_segments([trainer.proc.pid]) == []
        finally:
            trainer.close()
    finally:
        worker.world_size = 2


def test_reclaiming_never_touches_a_live_segment() -> None:
    seg = StagingSegment(4096, 2)
    try:
        other = StagingSegment(4096, 1)  # runs the reclaimer while ``seg`` is alive
        other.close()
        assert os.path.exists(seg.path), "a locked segment belongs to a live trainer"
    finally:
        seg.close()


# ------------------------------------------------- a segment truncated while it is copied out
@pytest.mark.parametrize("mode", ["shared", "ring"])
def test_a_segment_truncated_mid_copy_by_another_process_is_a_refused_round(
    procs: Any, mode: str
) -> None:
    """Another process truncates the segment while the worker copies tensor 3 out of it.

    Before, the copy read through the mapping and SIGBUS killed the worker (rc -7) on the
    first try; reads now go through the file descriptor, so the round is refused, nothing is
    published, and the same worker takes a healthy trainer's next round bit-exact.
    """
    state = procs.make_state(12)
    worker = procs.PipeWorker("--truncate-at-tensor", "3")
    trainer = procs.TrainerProc("12", str(4096), "1", *(["--shared"] if mode == "shared" else []))
    healthy = None
    try:
        worker.setup(state)
        before = worker.dump()
        announce = procs.relay_until_update(trainer, worker)
        assert announce["offsets" if mode == "shared" else "num_slots"], announce
        with pytest.raises(TransferError, match=r"truncated to \d+ bytes while"):
            worker.call("update_weights", announce, timeout_s=60)
        assert worker.proc.poll() is None, "the worker survived the truncation"
        info = worker.call("weight_info")
        assert info["weight_version"] != "r0", "nothing of the round is published"
        assert info["consistent"] is False, "part of the round landed: the model is mixed"
        assert any(not torch.equal(t, before[n]) for n, t in worker.dump().items())
        trainer.close()  # its own segment is gone under it; a fresh trainer takes over
        healthy = procs.TrainerProc("13", str(4096), "1")
        worker.call("abort")
        worker_state = procs.make_state(13)
        while True:  # relay the healthy trainer's whole round
            msg = healthy.next_message()
            procs.relay(healthy, worker, msg)
            if msg["call"] == "finish_weight_update":
                break
        procs.assert_bit_exact(worker.dump(), worker_state)
        assert worker.call("weight_info")["consistent"] is True
    finally:
        trainer.close()
        if healthy is not None:
            healthy.close()
        worker.kill()
        from wtcore_ipc.shm import reclaim_orphans

        reclaim_orphans()  # the killed trainer's segment (its owner is gone)
