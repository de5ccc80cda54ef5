"""``on_ranks`` and ``torchrun``: real spawned ranks and a real gloo rendezvous; the port race
and the ranks that fail, die or hang come back as clear errors, without waiting out the timeout."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import wtcore.testing.net as net
from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing import on_ranks, torchrun

pytestmark = pytest.mark.processes


def _gloo_rank(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        results.put((rank, port, float(t)))
    finally:
        dist.destroy_process_group()


def _rank_one_raises(rank: int, port: int, results: Any) -> None:
    if rank == 1:
        raise ValueError("rank one broke")
    _gloo_rank(rank, port, results)  # waits for a rank 1 that never comes


def _rank_one_is_killed(rank: int, port: int, results: Any) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)


def _rank_one_hangs(rank: int, port: int, results: Any) -> None:
    if rank == 0:
        results.put(rank)
    time.sleep(300)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port that a listening socket holds for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun`` kills the other ranks 2 s (not 10) after one failed: the rank that waits in
    the rendezvous for a failed one would otherwise be waited out for the whole grace."""
    monkeypatch.setattr(net, "RANK_GRACE_S", 2.0)


def _picked_first(monkeypatch: pytest.MonkeyPatch, port: int, *, always: bool = False) -> None:
    """``free_port`` hands out ``port`` first (or every time), then free ports as before."""
    ports, real = iter([port]), net.free_port
    monkeypatch.setattr(net, "free_port", lambda: port if always else next(ports, None) or real())


@pytest.mark.timeout(240)
def test_a_taken_rendezvous_port_is_retried_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    _picked_first(monkeypatch, taken_port)
    got = sorted(on_ranks(_gloo_rank, 2, timeout_s=120))
    assert [g[0] for g in got] == [0, 1] and {g[2] for g in got} == {3.0}  # a real all_reduce
    assert got[0][1] == got[1][1] != taken_port  # both ranks on one fresh port


@pytest.mark.timeout(240)
def test_a_taken_port_every_time_fails_naming_the_count(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    _picked_first(monkeypatch, taken_port, always=True)
    with pytest.raises(TransferError, match="port was taken 2 times in a row"):
        on_ranks(_gloo_rank, 2, timeout_s=120, attempts=2)


@pytest.mark.timeout(240)
def test_a_rank_that_raises_fails_the_call_at_once_naming_it() -> None:
    start = time.monotonic()
    with pytest.raises(TransferError, match="rank 1 failed") as err:
        on_ranks(_rank_one_raises, 2, timeout_s=200)
    assert "ValueError: rank one broke" in str(err.value)
    assert time.monotonic() - start < 150  # not the 200 s timeout, nor rank 0's 60 s rendezvous


@pytest.mark.timeout(240)
def test_a_rank_killed_by_a_signal_fails_the_call_naming_its_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"exit codes \[None, -9\]"):
        on_ranks(_rank_one_is_killed, 2, timeout_s=200)
    assert time.monotonic() - start < 150


@pytest.mark.timeout(120)
def test_a_rank_that_never_answers_times_out_naming_it() -> None:
    with pytest.raises(TransferTimeoutError, match=r"1 result\(s\) missing after 5 s .*\[0, 1\]"):
        on_ranks(_rank_one_hangs, 2, timeout_s=5)


GLOO_SCRIPT = """
import datetime, os, torch, torch.distributed as dist
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    raise SystemExit("rank " + os.environ["RANK"] + " gave up")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(os.environ["MASTER_PORT"], float(t))
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_torchrun_retries_a_taken_port_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    _picked_first(monkeypatch, taken_port)
    _short_grace(monkeypatch)  # the first try's rank 1 waits on a store that never answers
    ranks = torchrun([sys.executable, "-c", GLOO_SCRIPT], 2, timeout_s=200)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr for r in ranks]
    ports = {r.stdout.split()[0] for r in ranks}
    assert len(ports) == 1 and str(taken_port) not in ports  # both ranks on one fresh port
    assert {r.stdout.split()[1] for r in ranks} == {"3.0"}  # a real all_reduce


@pytest.mark.timeout(240)
def test_torchrun_stops_the_others_soon_after_a_rank_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _short_grace(monkeypatch)
    start = time.monotonic()
    ranks = torchrun([sys.executable, "-c", GLOO_SCRIPT], 2, env={"FAIL_RANK": "1"}, timeout_s=200)
    assert ranks[1].returncode == 1 and "rank 1 gave up" in ranks[1].stderr
    assert ranks[0].returncode == -signal.SIGKILL  # it waited for rank 1 (or was still starting)
    assert time.monotonic() - start < 150  # not its 120 s rendezvous, nor the 200 s timeout
