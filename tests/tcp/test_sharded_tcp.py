"""Sharded rounds on the tcp engine: the sharded contract suite over one stream per pair.

Real trainer processes in a gloo group, each listening for the receivers it sends to, and
real receivers (``WeightSyncWorker`` s holding TP slices) connecting to exactly the trainer
ranks the plan names. Also here: a receiver refuses a forged ``senders`` update before it
connects anywhere, and a trainer rank that never sends fails the round on every rank,
naming it, within the timeout.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.inproc import InProcessClient
from wtcore.testing.net import on_ranks
from wtcore.testing.sharded import PartsSource
from wtcore.testing.sharded_contract import (
    BUFFER,
    ShardedContractSuite,
    expected_slices,
    held_parts,
    receivers,
    trainer_layouts,
    whole,
)
from wtcore_tcp import TCPTrainerInitInfo
from wtcore_tcp.pairs import SendersUpdate


def tcp_info(rank: int, buffer_size_bytes: int, receivers: int) -> TCPTrainerInitInfo:
    return TCPTrainerInitInfo(
        address="127.0.0.1",
        world_size=1 + receivers,
        packed_buffer_size_bytes=buffer_size_bytes,
        timeout_s=30.0,
        rank=rank,
    )


class TestTCPSharded(ShardedContractSuite):
    backend = "tcp"
    trainer_info = staticmethod(tcp_info)


GOOD = {"address": "127.0.0.1", "port": 4000, "token": "ab" * 16}


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([GOOD], "the plan has 2 trainer ranks, got 1 entries"),
        ([GOOD, {**GOOD, "port": 0}], r"senders\[1\]\.port"),
        ([GOOD, {**GOOD, "port": True}], r"senders\[1\]\.port"),
        ([GOOD, {**GOOD, "token": "XYZ"}], r"senders\[1\]\.token"),
        ([GOOD, {**GOOD, "address": ""}], r"senders\[1\]\.address"),
        ([GOOD, {**GOOD, "extra": 1}], r"senders\[1\]: expected an object"),
        ([GOOD, "127.0.0.1:4000"], r"senders\[1\]: expected an object"),
    ],
)
def test_a_forged_senders_update_is_refused_naming_the_entry(entries: list, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        SendersUpdate(entries).checked(2)


class FailingParts(PartsSource):
    """Rank 1's parts, failing once while they are read (a trainer rank that breaks)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise RuntimeError("trainer rank 1's source broke")
        yield from ()


def _recovering_rank(rank: int, port: int, q: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    fleet = receivers(2, True, "tcp") if rank == 0 else []
    client = InProcessClient(fleet, timeout_s=60) if rank == 0 else None
    engine = WeightTransferTrainerFactory.trainer_init(tcp_info(rank, BUFFER, 2), client=client)
    out: dict[str, Any] = {"rank": rank}
    try:
        layouts = trainer_layouts("S0", 2)
        bad = FailingParts if rank == 1 else PartsSource
        try:
            engine.send_weights(bad(whole(), layouts, rank), weight_version="broken")
        except Exception as e:
            out["first"] = f"{type(e).__name__}: {e}"
        if rank == 0:
            out["after_failure"] = [w.weight_info() for w in fleet]
        stats = engine.send_weights(PartsSource(whole(), layouts, rank), weight_version="fixed")
        out["sent"], out["planned"] = stats.bytes_sent, stats.num_bytes
        if rank == 0:
            out["infos"] = [w.weight_info() for w in fleet]
            want = expected_slices(2, True)
            out["exact"] = [
                all(torch.equal(held_parts(w)[k], t) for k, t in want[r].items())
                for r, w in enumerate(fleet)
            ]
        q.put(out)
    finally:
        engine.shutdown()
        for w in fleet:
            w.shutdown()
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_rank_that_breaks_fails_the_round_everywhere_and_the_next_round_recovers() -> None:
    got = sorted(on_ranks(_recovering_rank, 2, timeout_s=200), key=lambda g: g["rank"])
    for g in got:  # every rank fails the round, naming the rank that broke
        assert "trainer rank 1's source broke" in g["first"], g
    for info in got[0]["after_failure"]:
        assert info["weight_version"] != "broken" and not info["consistent"], info
    for g in got:
        assert g["sent"] == g["planned"] > 0, g
    for info in got[0]["infos"]:
        assert info["consistent"] and info["weight_version"] == "fixed", info
    assert got[0]["exact"] == [True, True]
