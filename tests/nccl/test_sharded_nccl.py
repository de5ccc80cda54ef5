"""Sharded rounds on the nccl engine (gloo on CPU): the sharded contract suite in one group
of M trainer ranks + N receivers, point to point.

Real trainer processes in a gloo group of their own (the trainer's), each joining the round's
transfer group through rank 0's rendezvous store, and real receivers (``WeightSyncWorker`` s
holding TP slices). Also here: a header that disagrees with the plan is refused before the
receive is posted, and a trainer rank that breaks fails the round on every rank, naming it,
and the next round recovers bit-exact.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError, TransferError
from wtcore.testing import free_port
from wtcore.testing.sharded import PartsSource
from wtcore.testing.sharded_contract import (
    BUFFER,
    ShardedContractSuite,
    trainer_layouts,
    whole,
)
from wtcore_channel.frames import check_header, make_header
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_nccl.pairs import GroupUpdate

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


def test_a_header_that_disagrees_with_the_plan_is_refused_before_the_receive() -> None:
    data = torch.zeros(96, dtype=torch.uint8)
    header = make_header(3, data, "cpu", checksum=False)  # a sender whose plan differs
    with pytest.raises(TransferError, match="bucket 3 from trainer rank 1.*96 bytes.*64 bytes"):
        check_header(header, index=3, nbytes=64, what="bucket 3 from trainer rank 1")
    with pytest.raises(TransferError, match="announced bucket 3.*planned bucket 2"):
        check_header(header, index=2, nbytes=96, what="bucket 2 from trainer rank 0")
    with pytest.raises(TransferError, match="malformed"):
        check_header(torch.zeros(4, dtype=torch.int64), index=0, nbytes=0, what="bucket 0")


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


def test_a_sender_whose_bucket_disagrees_with_the_plan_is_refused_not_aborted() -> None:
    """A real gloo group of 2 (trainer rank 0, receiver 0) in this process: the sender
    announces (and sends) a bucket longer than the receiver planned. The receiver refuses it
    from the header, naming the trainer rank, before it posts the receive that would make
    gloo abort this process."""
    import threading

    from wtcore.meta import ParamMeta
    from wtcore.plan import PlannedRound
    from wtcore.receiver_layout import receiver_layouts
    from wtcore.sink import ModuleSink
    from wtcore_kit.concurrency import BackgroundCall
    from wtcore_kit.pairs import PairAssembler
    from wtcore_kit.synthetic import build_module
    from wtcore_nccl.group import connect_store, host_store, join_group
    from wtcore_nccl.pairs import receive_pairs

    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    planned = PlannedRound.make(metas, trainer_layouts("S0", 1), receiver_layouts([None], metas))
    sink = ModuleSink(build_module({k: torch.zeros_like(t) for k, t in full.items()}))
    assembler = PairAssembler.for_receiver(
        planned, rank=0, world_size=1, layout=None, buffer_size_bytes=BUFFER, sink=sink
    )
    port = free_port()
    store = host_store("127.0.0.1", port, 2, 10.0)
    kw: dict[str, Any] = dict(
        generation=0, world_size=2, transport="gloo", address="127.0.0.1", port=port,
        timeout_s=10.0, secret="cd" * 16,
    )  # fmt: skip
    planned_nbytes = assembler.buckets_from(0)[0][0].nbytes
    stop = threading.Event()

    def sender() -> None:
        group = join_group(connect_store("127.0.0.1", port, 10.0), rank=0, **kw)
        data = torch.ones(planned_nbytes + 64, dtype=torch.uint8)
        works = [group.pg.send([make_header(0, data, "cpu")], 1, 0), group.pg.send([data], 1, 0)]
        stop.wait(10)
        group.release(works)

    call = BackgroundCall(sender, name="hostile-sender")
    group = join_group(store, rank=1, **kw)
    try:
        with pytest.raises(TransferError, match=r"bucket 0 from trainer rank 0.*refusing"):
            receive_pairs(assembler, group, rank=0, device="cpu", timeout_s=10.0, poll=lambda: None)
    finally:
        stop.set()
        call.wait(15)
        group.release()
    assert list(assembler.missing())  # nothing of the refused bucket was applied


def test_a_sharded_round_over_nccl_is_refused_before_anything_moves() -> None:
    """Over NCCL (CUDA) each pair's thread would share one communicator, which NCCL does not
    allow; the round is refused at send_weights, naming the way out. (No GPU here: the engine
    is built for trainer rank 1, which needs no client and joins nothing until a round.)"""
    from wtcore_nccl import NCCLTrainerEngine

    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=29999, world_size=2, rank=1, transport="nccl",
        device="cuda",
    )  # fmt: skip
    engine = NCCLTrainerEngine(info, client=None, source=None)
    full = whole()
    source = PartsSource(full, trainer_layouts("S0", 2), 1)
    with pytest.raises(PayloadError, match="run over gloo"):
        engine.send_weights(source, weight_version="never")
    engine.shutdown()
