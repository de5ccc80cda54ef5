"""Shared memory as hostile ground (issue 14, items 7-9; issue 31, item 3): a small /dev/shm or a
refused reservation, a FIFO, a foreign file or an unsealed memfd named by an update, a peer that
truncates a segment, a trainer killed before any worker mapped its segment."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from wtcore_ipc.shm import CONTROL_BYTES, HEADER_BYTES

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


# ---------------------------------------------------------------------- item 7: memory limits
_ROUND_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, torch
    from wtcore import TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
    from wtcore_kit.inproc import InProcessClient
    from wtcore.sink import ModuleSink
    from wtcore.testing import build_module
    from wtcore_ipc import IPCTrainerInitInfo

    if sys.argv[1:] == ["--fsize-64m"]:  # a 64 MiB cap on any one file this process sizes
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
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
    out["dev_shm"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("wtcore"))
    out["consistent"] = worker.weight_info()["consistent"]
    out["equal"] = bool(torch.equal(worker.sink.module.w, state["w"]))
    trainer.shutdown()
    worker.shutdown()
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        links += [line.split()[-2] for line in maps if "/memfd:wtcore" in line]
    out["left"] = sorted(n for n in links if n.startswith("/memfd:wtcore"))
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounting a 64 MiB tmpfs over /dev/shm in a private mount namespace needs root "
    "and unshare(1)",
)
def test_a_small_dev_shm_no_longer_limits_the_ring() -> None:
    """Docker's default 64 MiB /dev/shm, a 128 MiB staging segment: it was a SIGBUS while
    packing, then a clear error. Segments are memfds now, outside /dev/shm: the round goes
    through, and nothing appears in /dev/shm."""
    script = 'mount -t tmpfs -o size=64m wtcore-test /dev/shm && exec "$0" -c "$1"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, _ROUND_CHILD],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, f"rc={proc.returncode} (-7 is SIGBUS): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is None, out["error"]
    assert out["equal"] is True and out["consistent"] is True
    assert out["dev_shm"] == [] and out["left"] == []


def test_a_refused_reservation_is_a_clear_error_and_leaves_nothing() -> None:
    """The kernel refuses the segment's pages (here RLIMIT_FSIZE at 64 MiB against a 128 MiB
    ring; a container's memory limit is the same ENOMEM/ENOSPC path): a WtcoreError naming the
    size and the fix, raised before anything is written, and no memfd is left open."""
    proc = subprocess.run(
        [sys.executable, "-c", _ROUND_CHILD, "--fsize-64m"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, f"rc={proc.returncode} (-7 is SIGBUS): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is not None, "the ring cannot be reserved under a 64 MiB cap"
    kind, message, mro = out["error"]
    assert "WtcoreError" in mro and kind == "TransferError"
    size = 4096 + 2 * (64 + (64 << 20))  # the control page, two slots of 64 MiB
    assert f"{size}-byte shared-memory segment" in message
    assert "memory limit" in message and "packed_buffer_size_bytes" in message
    assert out["left"] == [], "no memfd is left open"
    assert out["consistent"] is True, "nothing reached the worker"


# ---------------------------------------------------------------------- item 8 and issue 31
def _memfd(name: str, size: int, seals: int) -> int:
    """A memfd of this process, ``size`` bytes, with ``seals``: a forged segment."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _forged_name() -> str:
    return f"wtcore_ipc_{os.getpid()}_{secrets.token_hex(8)}"


FORGERIES = {
    # name: (what the announcement points at, the error it must get)
    "fifo": ("a FIFO (opening it would block)", "not to the announced memfd"),
    "regular_file": ("a file of this user in /tmp", "not to the announced memfd"),
    "other_memfd": ("a sealed memfd with another name", "not to the announced memfd"),
    "unsealed": ("the announced memfd, without seals", "a segment must carry F_SEAL_SHRINK"),
    "shrink_only": ("the announced memfd, sealed against shrinking only", "must carry F_SEAL"),
    "closed_fd": ("a descriptor the trainer does not hold", "holds no descriptor"),
}


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_an_update_naming_anything_but_the_sealed_memfd_is_refused(
    procs: Any, kind: str, tmp_path: Path
) -> None:
    """The announcement names a descriptor of the trainer (this process) that is not the
    announced, sealed memfd: refused at once, before anything is mapped or applied (a
    PayloadError naming the field), and the worker takes the next real round bit-exact.
    An unsealed memfd is refused because its owner, or anyone of the uid, could shrink it
    under the worker's mapping (a SIGBUS); a FIFO must not block the worker's open."""
    state = procs.make_state(11)
    worker = procs.PipeWorker()
    trainer = None
    fds: list[int] = []
    try:
        trainer, last = procs.after_a_good_round([worker], state)
        size = os.fstat(trainer._memory.fd).st_size
        name = _forged_name()
        if kind == "fifo":
            fifo = tmp_path / "fifo"
            os.mkfifo(fifo, 0o600)
            fds.append(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        elif kind == "regular_file":
            (tmp_path / "secret").write_bytes(b"x" * size)
            fds.append(os.open(tmp_path / "secret", os.O_RDWR))
        elif kind == "other_memfd":
            fds.append(_memfd(_forged_name(), size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW))
        elif kind == "unsealed":
            fds.append(_memfd(name, size, 0))
        elif kind == "shrink_only":
            fds.append(_memfd(name, size, fcntl.F_SEAL_SHRINK))
        fd = fds[-1] if fds else 1 << 30  # closed_fd: a number this process does not hold
        payload = {**last, "segment": name, "segment_fd": fd}
        procs.refused_then_synced([worker], trainer, state, payload, FORGERIES[kind][1])
        assert worker.proc.poll() is None
    finally:
        for fd in fds:
            os.close(fd)
        if trainer is not None:
            trainer.shutdown()
        worker.kill()


def test_a_truncation_is_refused_by_the_kernel(procs: Any) -> None:
    """Before memfds, a peer could truncate a segment under a worker's mapping (a SIGBUS,
    later a refused round). Now the segment is sealed: truncating it, from this process or
    another, through its /proc path, fails with EPERM, and the next round is bit-exact."""
    state = procs.make_state(12)
    worker = procs.PipeWorker()
    trainer = None
    try:
        trainer, _ = procs.after_a_good_round([worker], state)
        path = trainer._memory.path
        size = os.stat(path).st_size
        for length in (0, CONTROL_BYTES + HEADER_BYTES, size + 4096):
            with pytest.raises(PermissionError):
                os.truncate(path, length)
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):  # the seals cannot be taken off either
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(fd)
        cut = "import os, sys; os.truncate(sys.argv[1], 0)"
        other = subprocess.run(
            [sys.executable, "-c", cut, path], capture_output=True, text=True, timeout=60
        )
        assert other.returncode != 0 and "Operation not permitted" in other.stderr
        assert os.stat(path).st_size == size
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
def test_a_trainer_killed_before_its_first_update_leaves_nothing(
    two_workers: list[Any], procs: Any
) -> None:
    """The trainer staged its segment and was SIGKILLed before any worker mapped it. It used
    to leak a file in /dev/shm for good (then the next worker init reclaimed it); a memfd goes
    with its last holder, so nothing is left the moment the trainer is reaped, and the worker
    inits as before."""
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
            assert len(procs.our_segments([trainer.proc.pid])) == 1
            trainer.proc.kill()
            trainer.proc.wait(10)
            assert procs.our_segments([trainer.proc.pid]) == []
            worker.call("init_weight_transfer_engine", init)
        finally:
            trainer.close()
    finally:
        worker.world_size = 2


# ------------------------------------------------- a segment truncated while it is copied out
@pytest.mark.parametrize("mode", ["shared", "ring"])
def test_a_truncation_mid_copy_by_another_process_is_refused_by_the_kernel(
    procs: Any, mode: str
) -> None:
    """Another process tries to truncate the segment while the worker copies tensor 3 out of it.

    Through a mapping of an unsealed file that was a SIGBUS in the worker (rc -7), then, with
    reads through the descriptor, a refused round. The segment is sealed now: the truncation
    fails with EPERM in that process, the worker's mapping stays whole, and the round lands
    bit-exact, read through the mapping.
    """
    import errno

    state = procs.make_state(12)
    worker = procs.PipeWorker("--truncate-at-tensor", "3")
    trainer = procs.TrainerProc("12", str(4096), "1", *(["--shared"] if mode == "shared" else []))
    try:
        worker.setup(state)
        announce = procs.relay_until_update(trainer, worker)
        assert announce["offsets" if mode == "shared" else "num_slots"], announce
        procs.relay(trainer, worker, {"call": "update_weights", "args": [announce]})
        assert worker.call("truncation") == errno.EPERM, "the kernel refused the truncation"
        while True:  # relay the rest of the round
            msg = trainer.next_message()
            procs.relay(trainer, worker, msg)
            if msg["call"] == "finish_weight_update":
                break
        procs.assert_bit_exact(worker.dump(), procs.make_state(12))
        info = worker.call("weight_info")
        assert info["consistent"] is True and info["weight_version"] == "r0"
    finally:
        trainer.close()
        worker.kill()


# ---------------------------------------------------------------------- one PID namespace
@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a worker in its own PID namespace needs root and unshare(1)",
)
def test_a_worker_in_another_pid_namespace_fails_fast_saying_so(procs: Any) -> None:
    """Workers reach the trainer's segment through /proc/<trainer pid>/fd, so they must share
    its PID namespace. A worker in its own (``unshare --pid``, its own /proc) cannot see the
    trainer: the round fails at once with an error saying what ipc needs, nothing applied."""
    import time

    state = procs.make_state(14)
    worker = procs.PipeWorker(prefix=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"))
    trainer = None
    try:
        worker.setup(state)
        before = worker.dump()
        trainer, _ = procs.trainer_for([worker], state, packed_buffer_size_bytes=4096)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="one PID namespace") as caught:
            trainer.send_weights(weight_version="v1")
        assert "TransferError" in repr(caught.value) or "TransferError" in str(caught.value)
        assert time.monotonic() - t0 < 20, "at once, not at a timeout"
        procs.assert_bit_exact(worker.dump(), before)
        assert worker.call("weight_info")["weight_version"] is None
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.kill()
