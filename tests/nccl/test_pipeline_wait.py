"""``wait_work`` never reports a completed broadcast as failed.

A short wait that expires raises in torch; when the broadcast completes between that expiry
and the check that follows, the completed operation used to be read as a failure (about one
round in ten against a real server). Here a real gloo group (two ranks on threads of this
process, over loopback) runs many broadcasts while the receiver waits with 1 ms polls, so
completions land in that window many times.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from wtcore.errors import TransferError
from wtcore.testing import free_port
from wtcore_channel import pipeline
from wtcore_channel.pipeline import wait_work
from wtcore_kit.concurrency import BackgroundCall
from wtcore_nccl.group import Group, connect_store, host_store, join_group

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

ROUNDS = 1000


def _join(store: object, rank: int, port: int) -> Group:
    return join_group(
        store,
        generation=1,
        rank=rank,
        world_size=2,
        transport="gloo",
        address="127.0.0.1",
        port=port,
        timeout_s=30,
    )


def _send_all(group: Group, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        group.broadcast(t).wait()


def test_many_short_waits_never_report_a_completed_broadcast_as_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pipeline, "_POLL_TD", datetime.timedelta(milliseconds=1))
    port = free_port()
    master = host_store("127.0.0.1", port, 2, 30)
    calls = [
        BackgroundCall(_join, master, 0, port),
        BackgroundCall(_join, connect_store("127.0.0.1", port, 30), 1, port),
    ]
    sender, receiver = (c.result(30) for c in calls)
    g = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 256 << 10, (ROUNDS,), generator=g)]
    sent = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    feeder = BackgroundCall(_send_all, sender, sent, name="sender")
    for i, n in enumerate(sizes):
        got = torch.zeros(n, dtype=torch.uint8)
        try:
            wait_work(receiver.broadcast(got), what=f"receive {i}", timeout_s=30)
        except TransferError as e:
            pytest.fail(f"receive {i} of {ROUNDS} completed but was reported as failed: {e}")
        assert torch.equal(got, sent[i]), i
    feeder.result(30)
