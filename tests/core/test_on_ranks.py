"""``on_ranks``: real spawned ranks and a real gloo rendezvous; the port race and the ranks
that fail, die or hang come back as clear errors, without waiting out the timeout."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
from typing import Any

import pytest

import wtcore.testing.net as net
from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing import on_ranks


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


@pytest.mark.timeout(240)
def test_a_taken_rendezvous_port_is_retried_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port])
        real = net.free_port
        monkeypatch.setattr(net, "free_port", lambda: next(ports, None) or real())
        got = sorted(on_ranks(_gloo_rank, 2, timeout_s=120))
    assert [g[0] for g in got] == [0, 1] and {g[2] for g in got} == {3.0}  # a real all_reduce
    assert got[0][1] == got[1][1] != port  # both ranks on one fresh port, not the taken one


@pytest.mark.timeout(240)
def test_a_taken_port_every_time_fails_naming_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(net, "free_port", lambda: taken.getsockname()[1])
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
