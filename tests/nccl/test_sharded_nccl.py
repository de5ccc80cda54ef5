"""Sharded rounds on the nccl engine (gloo on CPU): the sharded contract suite in one group
of M trainer ranks + N receivers, point to point, every rank's pairs issued from one thread
in the steps of one schedule (the code NCCL runs; tests/integration/test_gpu_processes.py
runs a round over NCCL itself, on two GPUs).

Real trainer processes in a gloo group of their own (the trainer's), each joining the round's
transfer group through rank 0's rendezvous store, and real receivers (``WeightSyncWorker`` s
holding TP slices). Also here: steps of one bucket and of many per rank, a trainer rank whose
terms (plan, bucket size, buffers) differ from rank 0's failing the round on every rank
before any byte moves, and a forged group update refused naming its field.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from wtcore.errors import PayloadError
from wtcore.testing import free_port
from wtcore.testing.sharded_contract import ShardedContractSuite, run_ranks
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_nccl.pairs import GroupUpdate, RoundTerms, check_terms

pytestmark = pytest.mark.processes

#: Every trainer rank must name the same store port; the test sets it before spawning.
PORT_ENV = "WTCORE_TEST_NCCL_SHARDED_PORT"


def nccl_info(rank: int, buffer_size_bytes: int, receivers: int) -> NCCLTrainerInitInfo:
    return NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=int(os.environ[PORT_ENV]),
        world_size=1 + receivers,
        rank=rank,
        packed_buffer_size_bytes=buffer_size_bytes,
        timeout_s=30.0,
    )


@pytest.fixture(autouse=True)
def _store_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_ENV, str(free_port()))


class TestNCCLSharded(ShardedContractSuite):
    backend = "nccl"
    trainer_info = staticmethod(nccl_info)


@pytest.mark.parametrize(
    ("update", "match"),
    [
        (GroupUpdate("ab" * 16, 3), "the plan has 2 trainer ranks, got 3"),
        (GroupUpdate("ab" * 16, True), "trainer_ranks"),  # type: ignore[arg-type]
        (GroupUpdate("XYZ", 2), "group.secret"),
    ],
)
def test_a_forged_group_update_is_refused_naming_the_field(update: GroupUpdate, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        update.checked(2)


def nccl_info_one_buffer(rank: int, buffer_size_bytes: int, receivers: int) -> NCCLTrainerInitInfo:
    return replace(nccl_info(rank, buffer_size_bytes, receivers), packed_num_buffers=1)


def nccl_info_five_buffers(
    rank: int, buffer_size_bytes: int, receivers: int
) -> NCCLTrainerInitInfo:
    return replace(nccl_info(rank, buffer_size_bytes, receivers), packed_num_buffers=5)


def nccl_info_rank1_differs(
    rank: int, buffer_size_bytes: int, receivers: int
) -> NCCLTrainerInitInfo:
    return replace(nccl_info(rank, buffer_size_bytes, receivers), packed_num_buffers=2 + rank)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("info", [nccl_info_one_buffer, nccl_info_five_buffers])
def test_steps_of_one_and_of_many_buckets_per_rank_are_exact(info: Any) -> None:
    """The suite runs 2 buffers; here 1 (every step one bucket per rank) and 5 (a step holds
    several buckets of one pair, matched in order), 2 trainer ranks into 3 TP receivers."""
    got = run_ranks(info, "nccl", 2, 3, "S1")
    assert all("error" not in g for g in got), got
    for g in got:
        assert g["sent"] == g["planned"] > 0, g
    for r, (info_, exact) in enumerate(zip(got[0]["infos"], got[0]["exact"], strict=True)):
        assert info_["consistent"] and info_["weight_version"] == "sharded-1", info_
        assert all(exact.values()), (r, exact)


@pytest.mark.timeout(300)
def test_a_trainer_rank_whose_terms_differ_from_rank_0s_fails_the_round_before_any_byte() -> None:
    """Trainer rank 1 has 3 buffers, rank 0 (whose init the receivers follow) 2: its steps
    would not be theirs. Every rank fails naming it and the field; nothing is published."""
    got = run_ranks(nccl_info_rank1_differs, "nccl", 2, 2, "S0")
    for g in got:
        assert "trainer rank 1: its packed_num_buffers is 3" in g.get("error", ""), g
    for info_ in got[0]["infos"]:
        assert info_["weight_version"] != "sharded-1" and not info_["consistent"], info_


@pytest.mark.parametrize("field", RoundTerms._fields)
def test_check_terms_names_the_field_that_differs(field: str) -> None:
    rank0 = RoundTerms("sha256:ab", 160, 2)
    check_terms(rank0, rank0, 1)
    ours = rank0._replace(**{field: "sha256:cd" if field == "digest" else 7})
    with pytest.raises(PayloadError, match=f"trainer rank 1: its {field} is .*trainer rank 0's"):
        check_terms(ours, rank0, 1)
