"""Loopback ports and child processes that tests start and always stop."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing.procs import stop_processes

__all__ = ["free_port", "on_ranks", "spawned", "torchrun"]

RANK_GRACE_S = 10.0
"""How long ``torchrun``'s other ranks may still run once one failed."""

PORT_TAKEN = "EADDRINUSE"
"""What a rank's error says when the rendezvous port was taken (torch's store names the errno);
``on_ranks`` and ``torchrun`` run such a round again on a fresh port."""


PORTS_FROM = 20000
"""The lowest port :func:`free_port` draws (clear of the well-known and registered ports
that local services most often use)."""

#: The ports this process handed out lately (a test may pick several before binding any).
_given: collections.deque[int] = collections.deque(maxlen=512)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now, outside the kernel's ephemeral range.

    The caller (or a child) binds it later, and until then another socket can take it. The
    likeliest taker is any connection the host opens meanwhile: the kernel gives each one a
    source port from ``ip_local_port_range``, as it gives ``bind(0)``. So the port is drawn
    below that range (where neither ever lands), checked free by binding it, and not handed
    out again by this process for a while. Fine for benchmarks and tests on one host, never
    for production rendezvous with fixed ports.
    """
    low, high = _ephemeral_range()
    pool = range(PORTS_FROM, low) if low - PORTS_FROM >= 1000 else range(high + 1, 65536)
    for _ in range(200):
        port = random.choice(pool)
        if port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use (or lingering in TIME_WAIT): draw another
        _given.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded host: any port
        s.bind((host, 0))
        return int(s.getsockname()[1])


@functools.cache
def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for source ports and ``bind(0)`` (Linux's default if unreadable),
    read once per process."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


@contextlib.contextmanager
def spawned(
    target: Callable[..., Any], *args: Any, join_timeout_s: float = 10.0, **kwargs: Any
) -> Iterator[mp.process.BaseProcess]:
    """Run ``target`` in a fresh (``spawn``) process; on exit, join it or kill it by PID.

    ``spawn`` keeps the child free of the parent's threads and torch state, and the process
    is always stopped, even when the test body fails.
    """
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=target, args=args, kwargs=kwargs, daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        stop_processes([proc], join_timeout_s)
        proc.close()


def on_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 90.0,
    attempts: int = 3,
    killed: tuple[int, ...] = (),
) -> list[Any]:
    """Run ``target(rank, port, results, *args)`` in ``world`` spawned processes at once: the
    ranks of one process group, ``port`` a free rendezvous port, ``results`` a queue on which
    each puts one item. Returns the ``world`` items in arrival order; every process is
    stopped, even when one never answers.

    The port is picked here and bound later by a rank, so another socket can take it in
    between: a round whose rank fails with ``EADDRINUSE`` (as torch's store reports it) is
    run again on a fresh port, at most ``attempts`` times. A rank that fails otherwise (or
    dies) fails the call at once, naming the rank and its error, instead of leaving the
    others to wait out ``timeout_s`` for a rendezvous that cannot happen; but the ranks in
    ``killed``, which put their item and are then killed on purpose, leave the others time.
    """
    for _ in range(attempts):
        with contextlib.suppress(_PortTaken):
            return _one_try(target, world, args, timeout_s, killed)
    raise TransferError(f"on_ranks: the rendezvous port was taken {attempts} times in a row")


class _PortTaken(Exception):
    """A rank could not bind the rendezvous port (another socket took it)."""


@dataclasses.dataclass(frozen=True)
class _RankFailed:
    """What a rank whose ``target`` raised puts on the results queue instead of its item."""

    rank: int
    error: str


def _run_rank(target: Callable[..., Any], rank: int, port: int, results: Any, *args: Any) -> None:
    """A rank's body: ``target``, its exception put on ``results`` for the parent to see."""
    try:
        target(rank, port, results, *args)
    except Exception:
        results.put(_RankFailed(rank, traceback.format_exc()))
        raise


def _next(
    results: Any,
    procs: list[Any],
    deadline: float,
    timeout_s: float,
    missing: int,
    killed: tuple[int, ...] = (),
) -> Any:
    """The next item on ``results``; fails as soon as no item can come any more (every rank
    ended, or one was killed by a signal) or at ``deadline``."""
    while True:
        with contextlib.suppress(queue.Empty):
            return results.get(timeout=max(0.01, min(0.5, deadline - time.monotonic())))
        codes = [p.exitcode for p in procs]
        signalled = any(c is not None and c < 0 for r, c in enumerate(codes) if r not in killed)
        if all(c is not None for c in codes) or signalled:
            with contextlib.suppress(queue.Empty):  # what a rank put as it ended may still come
                return results.get(timeout=1.0)
            raise TransferError(
                f"on_ranks: {missing} result(s) missing and the ranks ended with "
                f"exit codes {codes} (by rank; negative: killed by that signal)"
            )
        if time.monotonic() >= deadline:
            alive = [r for r, c in enumerate(codes) if c is None]
            raise TransferTimeoutError(
                f"on_ranks: {missing} result(s) missing after {timeout_s} s "
                f"(ranks still running: {alive})"
            )


def _one_try(
    target: Callable[..., Any],
    world: int,
    args: tuple[Any, ...],
    timeout_s: float,
    killed: tuple[int, ...] = (),
) -> list[Any]:
    results = mp.get_context("spawn").Queue()
    port = free_port()
    got: list[Any] = []
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(spawned(_run_rank, target, rank, port, results, *args))
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world:
                item = _next(results, procs, deadline, timeout_s, world - len(got), killed)
                if isinstance(item, _RankFailed):
                    if PORT_TAKEN in item.error:
                        raise _PortTaken
                    raise TransferError(f"on_ranks: rank {item.rank} failed:\n{item.error}")
                got.append(item)
        except BaseException:  # the others wait for a rank that is gone: stop them all at once
            stop_processes(procs, 5.0, sig=signal.SIGTERM)
            raise
    return got


def torchrun(
    argv: Sequence[str],
    world: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 240.0,
    attempts: int = 3,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``argv`` as ``world`` ranks at once, with the variables torchrun sets (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``env``: each
    rank's exit status and output, in rank order. Every process is killed by PID if it has
    not ended in ``timeout_s`` (or when the caller fails meanwhile). A run in which a rank
    reports ``EADDRINUSE`` (another socket took ``MASTER_PORT`` after it was picked) is run
    again on a fresh port, at most ``attempts`` times in all."""
    ranks = _torchrun_once(argv, world, env, timeout_s)
    for _ in range(attempts - 1):
        if not any(PORT_TAKEN in r.stderr for r in ranks):
            break
        ranks = _torchrun_once(argv, world, env, timeout_s)
    return ranks


def _torchrun_once(
    argv: Sequence[str], world: int, env: Mapping[str, str] | None, timeout_s: float
) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    with contextlib.ExitStack() as files:
        outs = [
            (
                files.enter_context(tempfile.TemporaryFile("w+")),
                files.enter_context(tempfile.TemporaryFile("w+")),
            )
            for _ in range(world)
        ]
        try:
            for rank, (out, err) in enumerate(outs):
                rank_env = {
                    **os.environ,
                    **(env or {}),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                procs.append(
                    subprocess.Popen(list(argv), env=rank_env, stdout=out, stderr=err, text=True)
                )
            _wait_ranks(procs, timeout_s)
        finally:
            stop_processes(procs, 0.0)  # kills, by PID, whatever still runs
        texts = []
        for out, err in outs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    return [
        subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        for p, (out, err) in zip(procs, texts, strict=True)
    ]


def _wait_ranks(procs: list[subprocess.Popen[str]], timeout_s: float) -> None:
    """Wait until every rank ended; once one failed, the others get ``RANK_GRACE_S`` to end
    too (they may wait on it in a rendezvous). Raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while [p.poll() for p in procs].count(None):  # polls them all (any() would stop early)
        failed = any(p.returncode for p in procs)
        if failed:
            deadline = min(deadline, time.monotonic() + RANK_GRACE_S)
        if time.monotonic() >= deadline:
            if failed:
                return  # the failed rank's output says why; the others are killed
            running = [r for r, p in enumerate(procs) if p.returncode is None]
            raise TransferTimeoutError(
                f"torchrun: ranks {running} still running after {timeout_s} s"
            )
        time.sleep(0.1)
