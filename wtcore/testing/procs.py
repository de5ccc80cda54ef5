"""Stop child processes we started, always, by PID: one helper for the bench, tests and tools.

Only the processes passed in are touched, never anything found by name. :func:`freeze` returns
only once every thread is stopped: the kernel stops them one after another, so a woken thread
could still answer a peer after ``kill`` returned, and a stalled-peer test would race it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any

from wtcore.errors import TransferTimeoutError

__all__ = ["freeze", "stop_processes"]

#: Seconds to wait for a process to be reaped after ``SIGKILL``.
KILL_WAIT_S = 5.0


def stop_processes(
    procs: Iterable[Any], timeout_s: float, *, sig: int | None = None, group: bool = False
) -> list[int]:
    """Stop every process in ``procs`` (``multiprocessing`` or ``Popen``): send ``sig`` (after
    ``SIGCONT``) if given, wait ``timeout_s`` in all, then ``SIGKILL`` survivors; returns their
    PIDs. ``group``: each leads its own process group, which gets ``sig`` and, at the end,
    ``SIGKILL`` even when its leader exited (its children can outlive it)."""
    procs = [p for p in procs if p.pid is not None]  # never started: nothing to stop
    if sig is not None:
        for p in procs:
            if _alive(p):
                with contextlib.suppress(ProcessLookupError):
                    _signal(p.pid, signal.SIGCONT, group)
                    _signal(p.pid, sig, group)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        _wait(p, max(0.0, deadline - time.monotonic()))
    killed = []
    for p in procs:
        if _alive(p):
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            killed.append(int(p.pid))
            _wait(p, KILL_WAIT_S)
    if group:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    return killed


def freeze(pid: int, timeout_s: float = 30.0) -> None:
    """``SIGSTOP`` the process ``pid`` (one we started) and wait until all its threads are
    stopped, bounded by ``timeout_s``."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = _thread_states(pid)
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"process {pid} not stopped after {timeout_s:g} s (thread states {states!r})"
            )
        time.sleep(0.001)


def _thread_states(pid: int) -> str:
    states = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{pid}/task/{tid}/stat") as f,
            ):
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    return "".join(states)


def _signal(pid: int, sig: int, group: bool) -> None:
    if group:
        os.killpg(pid, sig)
    else:
        os.kill(pid, sig)


def _alive(p: Any) -> bool:
    if isinstance(p, subprocess.Popen):
        return p.poll() is None
    return bool(p.is_alive())


def _wait(p: Any, timeout_s: float) -> None:
    if isinstance(p, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout_s)
    else:
        p.join(timeout_s)
