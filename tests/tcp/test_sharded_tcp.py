"""Sharded rounds on the tcp engine: the sharded contract suite over one stream per pair.

Real trainer processes in a gloo group, each listening for the receivers it sends to, and
real receivers (``WeightSyncWorker`` s holding TP slices) connecting to exactly the trainer
ranks the plan names. Also here: a receiver refuses a forged ``senders`` update before it
connects anywhere, and a trainer rank that never sends fails the round on every rank,
naming it, within the timeout.
"""

from __future__ import annotations

import pytest

from wtcore.errors import PayloadError
from wtcore.testing.sharded_contract import (
    ShardedContractSuite,
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
