"""Loopback ports and child processes that tests start and always stop."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from wtcore.testing.procs import stop_processes

__all__ = ["free_port", "on_ranks", "spawned", "torchrun"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Another process can take it before the caller binds it; that race is acceptable for
    benchmarks and tests on one host, never for production rendezvous with fixed ports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    target: Callable[..., Any], world: int, *args: Any, timeout_s: float = 90.0
) -> list[Any]:
    """Run ``target(rank, port, results, *args)`` in ``world`` spawned processes at once: the
    ranks of one process group, ``port`` a free rendezvous port, ``results`` a queue on which
    each puts one item. Returns the ``world`` items in arrival order; every process is
    stopped, even when one never answers (a ``queue.Empty`` after ``timeout_s``)."""
    results = mp.get_context("spawn").Queue()
    port = free_port()
    with contextlib.ExitStack() as stack:
        for rank in range(world):
            stack.enter_context(spawned(target, rank, port, results, *args))
        return [results.get(timeout=timeout_s) for _ in range(world)]


def torchrun(
    argv: Sequence[str],
    world: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 240.0,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``argv`` as ``world`` ranks at once, with the variables torchrun sets (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``env``: each
    rank's exit status and output, in rank order. Every process is killed by PID if it has
    not ended in ``timeout_s`` (or when the caller fails meanwhile)."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
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
                subprocess.Popen(
                    list(argv),
                    env=rank_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    return [
        subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]
