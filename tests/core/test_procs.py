"""``stop_processes`` and ``freeze``: real children (subprocess and multiprocessing), by PID."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from wtcore.errors import TransferTimeoutError
from wtcore.testing import wait_until
from wtcore.testing.procs import freeze, stop_processes

pytestmark = pytest.mark.processes

IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def _python(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_signal_stops_a_cooperative_child_without_a_kill() -> None:
    with _python("import time\nprint('ready', flush=True)\ntime.sleep(120)\n") as proc:
        assert stop_processes([proc], 30.0, sig=signal.SIGTERM) == []
    assert proc.returncode == -signal.SIGTERM


def test_a_child_that_ignores_the_signal_is_killed_after_the_timeout() -> None:
    with _python(IGNORES_SIGTERM) as proc:
        start = time.monotonic()
        assert stop_processes([proc], 0.5, sig=signal.SIGTERM) == [proc.pid]
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - start < 30


def test_a_stopped_child_is_continued_so_it_can_act_on_the_signal() -> None:
    with _python("import time\nprint('ready', flush=True)\ntime.sleep(120)\n") as proc:
        os.kill(proc.pid, signal.SIGSTOP)
        assert stop_processes([proc], 30.0, sig=signal.SIGTERM) == []
    assert proc.returncode == -signal.SIGTERM


def test_multiprocessing_children_one_deadline_for_all() -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Process(target=time.sleep, args=(0,), daemon=True)
    stuck = [ctx.Process(target=time.sleep, args=(120,), daemon=True) for _ in range(2)]
    never_started = ctx.Process(target=time.sleep, args=(0,))
    for p in (done, *stuck):
        p.start()
    done.join(60)
    start = time.monotonic()
    killed = stop_processes([done, *stuck, never_started], 1.0)
    assert sorted(killed) == sorted(p.pid for p in stuck)
    assert time.monotonic() - start < 15  # one shared deadline, not one per process
    assert not any(p.is_alive() for p in (done, *stuck))
    assert done.exitcode == 0 and all(p.exitcode == -signal.SIGKILL for p in stuck)


def test_a_group_is_signalled_and_its_leftover_children_killed() -> None:
    # The leader exits on SIGTERM; its child ignores SIGTERM and would outlive it.
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}],"
        " stdout=subprocess.PIPE, text=True)\n"
        "assert child.stdout.readline() == 'ready\\n'\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as leader:
        assert leader.stdout is not None
        child_pid = int(leader.stdout.readline())
        assert stop_processes([leader], 30.0, sig=signal.SIGTERM, group=True) == []
    assert leader.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child_pid}") and _state(child_pid) != "Z":
        assert time.monotonic() < deadline, f"the group's child {child_pid} outlived the stop"
        time.sleep(0.05)


def _state(pid: int) -> str | None:
    try:
        return _stat(pid)[0]
    except OSError:
        return None


BUSY_THREADS = (
    "import threading, time\n"
    "def spin():\n"
    "    while True: pass\n"
    "for _ in range(3): threading.Thread(target=spin, daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def test_freeze_returns_once_every_thread_is_stopped() -> None:
    """Three spinning threads and a sleeping one: after ``freeze`` none runs, so the process
    uses no more CPU time; ``SIGCONT`` runs them again."""
    with _python(BUSY_THREADS) as proc:
        try:
            freeze(proc.pid)
            tasks = os.listdir(f"/proc/{proc.pid}/task")
            assert len(tasks) == 4
            assert [_stat(proc.pid, tid)[0] for tid in tasks] == ["T"] * 4
            before = _cpu_ticks(proc.pid)
            time.sleep(0.2)
            assert _cpu_ticks(proc.pid) == before
            os.kill(proc.pid, signal.SIGCONT)
        finally:
            stop_processes([proc], 30.0, sig=signal.SIGTERM)


def test_freeze_of_a_process_that_cannot_stop_fails_naming_it() -> None:
    """An exited, unreaped child (a zombie) never reaches the stopped state."""
    with _python("print('ready', flush=True)\n") as proc:
        wait_until(lambda: _state(proc.pid) == "Z", 30, "the child exited", poll_s=0.01)
        with pytest.raises(
            TransferTimeoutError, match=f"process {proc.pid} not stopped after 0.2 s"
        ):
            freeze(proc.pid, timeout_s=0.2)
        proc.wait(30)


def _stat(pid: int, tid: str | None = None) -> list[str]:
    """The fields of ``/proc``'s stat of ``pid`` (or of its thread ``tid``) after the name."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def _cpu_ticks(pid: int) -> int:
    fields = _stat(pid)  # utime and stime are fields 14 and 15 of stat, 12 and 13 here
    return int(fields[11]) + int(fields[12])
