"""The relay chain (``topology="chain"``) on loopback: 3 worker processes, real TCP streams.

Rank 1 receives from the trainer and relays to rank 2, which relays to rank 3; messages
larger than a relay's piece travel as several pieces, relayed while the next one arrives.
After every round each worker holds the trainer's weights bit for bit, packed and unpacked,
across buffer sizes and a re-handshake. (The namespaced version, with a relay that dies, is
in tests/multinode/test_chain.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.nccl.nccl_e2e_kit import fleet, make_state
from wtcore import PayloadError, TensorSource, WeightTransferTrainerFactory
from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing import MismatchedSource, spec_of, wait_until
from wtcore_channel.listen import listen_on
from wtcore_channel.pipeline import wait_work
from wtcore_kit.concurrency import BackgroundCall
from wtcore_tcp import TCPInitInfo, TCPTrainerInitInfo
from wtcore_tcp.chain import accept_chain, connect_chain
from wtcore_tcp.streams import RELAY_CHUNK, Stream, accept_lanes

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

#: A float32 tensor of 2.5 pieces: several pieces per message, the last one short.
BIG_NUMEL = RELAY_CHUNK * 5 // 8
TOKEN = "ab" * 16


def _info(workers: int, **kw: object) -> TCPTrainerInitInfo:
    return TCPTrainerInitInfo(
        address="127.0.0.1",
        world_size=1 + workers,
        timeout_s=20.0,
        topology="chain",
        rank=0,
        **kw,  # type: ignore[arg-type]
    )


def test_chain_rounds_bit_exact_over_three_workers() -> None:
    workers = 3
    state0 = make_state(0, big=BIG_NUMEL)
    with fleet(workers, spec_of(state0), backend="tcp", options={}) as f:
        seed = 1
        for packed, buffer_size in ((True, 16 << 10), (False, 1 << 30)):
            info = _info(workers, packed=packed, packed_buffer_size_bytes=buffer_size)
            assert info.worker_init_info(1, TOKEN).topology == "chain"
            with WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer:
                for _ in range(2):
                    state = make_state(seed, big=BIG_NUMEL)
                    seed += 1
                    version = f"chain-{packed}-{buffer_size}-{seed}"
                    trainer.send_weights(TensorSource(state), weight_version=version)
                    f.assert_synced(state, version)
                trainer.handshake()  # new streams (a new chain) from the same workers
                state = make_state(seed, big=BIG_NUMEL)
                trainer.send_weights(TensorSource(state), weight_version="after-rehandshake")
                f.assert_synced(state, "after-rehandshake")


@pytest.mark.parametrize("cls", [TCPTrainerInitInfo, TCPInitInfo])
def test_topology_option_is_validated(cls: type) -> None:
    common = {"address": "127.0.0.1", "world_size": 2}
    extra = (
        {"rank": 0} if cls is TCPTrainerInitInfo else {"port": 1, "token": TOKEN, "rank_offset": 1}
    )
    with pytest.raises(PayloadError, match="topology: expected .*fanout.*chain, got"):
        cls(**common, **extra, topology="ring")
    info = cls(**common, **extra)
    worker = info.worker_init_info(1, TOKEN) if cls is TCPTrainerInitInfo else info
    # One worker: the trainer's auto is the fan-out (a chain of one hop is the same streams);
    # a worker init that names no topology (an older trainer) is the fan-out.
    assert worker.topology == "fanout"
    if cls is TCPTrainerInitInfo:  # two workers or more: the chain
        assert (
            cls(**{**common, "world_size": 3}, **extra).worker_init_info(1, TOKEN).topology
            == "chain"
        )
    else:  # workers get a concrete topology
        with pytest.raises(PayloadError, match="topology"):
            cls(**common, **extra, topology="auto")


@contextmanager
def _chain_on_threads(world: int, timeout_s: float) -> Iterator[list[Stream]]:
    """Every rank of a chain on loopback, joined on threads of this process (real sockets,
    the real handshake); each rank's streams are released on exit."""
    listener = listen_on("127.0.0.1", 0, "the test's stream port", field="")
    port = listener.getsockname()[1]
    with listener:
        kw = {"world_size": world, "token": TOKEN, "timeout_s": timeout_s}
        calls = [BackgroundCall(accept_chain, listener, **kw)]
        for r in range(1, world):
            calls.append(BackgroundCall(connect_chain, "127.0.0.1", port, rank=r, **kw))
        streams = [c.result(30) for c in calls]
    try:
        yield streams
    finally:
        for s in streams:
            s.release()


def test_a_stalled_chain_names_the_rank_it_waits_for() -> None:
    """Three ranks on threads of this process (the real handshake, real streams); rank 0
    never sends.

    Rank 2 waits on rank 1, which waits on rank 0: each wait that runs out says which rank
    it waits for, and once the streams' own timeout ends the receive, the failure names it
    too, with its address; rank 2's names rank 1.
    """
    world = 3
    with _chain_on_threads(world, timeout_s=3.0) as groups:
        bufs = [torch.zeros(64, dtype=torch.uint8) for _ in range(world)]
        works = [groups[r].broadcast(bufs[r]) for r in (1, 2)]
        for rank, work in zip((1, 2), works, strict=True):
            with pytest.raises(TransferTimeoutError, match=f"from rank {rank - 1} \\(the previous"):
                wait_work(work, what=f"rank {rank}'s receive", timeout_s=0.3)
        first = r"receiving a message of 64 bytes from rank 0 \(the previous rank of the chain\)"
        with pytest.raises(TransferError, match=f"{first} at 127.0.0.1:.* timed out after 3 s"):
            wait_work(works[0], what="rank 1's receive", timeout_s=30)
        with pytest.raises(TransferError, match=r"from rank 1 \(the previous rank of the chain\)"):
            wait_work(works[1], what="rank 2's receive", timeout_s=30)


@pytest.mark.parametrize("published", ["", "127.0.0.1", "127.0.0.1 0", "127.0.0.1 70000", "h x"])
def test_a_malformed_chain_address_from_the_sender_is_refused_naming_the_rank(
    published: str,
) -> None:
    """A chain address comes through the sender and is checked before it is used."""
    listener = listen_on("127.0.0.1", 0, "the test's stream port", field="")
    port = listener.getsockname()[1]

    def sender() -> None:  # signed lanes of rank 2, then where rank 1 "listens"
        lanes = accept_lanes(listener, ranks=[2], token=TOKEN, timeout_s=10)
        lanes[(2, 0)].sendall(published.encode().ljust(64, b"\0"))
        for sock in lanes.values():
            sock.close()

    with listener:
        call = BackgroundCall(sender)
        with pytest.raises(
            PayloadError, match="rank 1's chain address from the sender is malformed"
        ):
            connect_chain("127.0.0.1", port, rank=2, world_size=3, token=TOKEN, timeout_s=5)
        call.result(10)


@pytest.mark.parametrize("kind", ["reshaped", "missing", "reordered"])
def test_a_round_abandoned_while_a_relay_hands_a_message_on_recovers(kind: str) -> None:
    """The trainer's source breaks mid-round (a tensor of another shape, one missing, two
    swapped) while the relay may still be handing a message on in pieces: both receivers
    fail the round at once and keep the old version (``consistent: false``; the relay's cut
    message fails on its last piece instead of waiting forever for its send), and the next
    round re-runs the handshake and is bit-exact."""
    good = make_state(1)
    with (
        fleet(2, spec_of(good), timeout_s=40.0, backend="tcp", options={}) as f,
        WeightTransferTrainerFactory.trainer_init(
            _info(2, packed_buffer_size_bytes=4 << 10), client=f.client
        ) as trainer,
    ):
        trainer.send_weights(TensorSource(good), weight_version="good")
        t0 = time.monotonic()
        with pytest.raises(PayloadError, match="metadata"):
            trainer.send_weights(
                MismatchedSource(TensorSource(make_state(2)), kind), weight_version="bad"
            )
        assert time.monotonic() - t0 < 20.0
        for i in range(2):
            wait_until(
                lambda i=i: f.client.call(i, "weight_info")["state"] == "idle",
                20.0,
                f"worker {i} to end the round",
            )
            info = f.client.call(i, "weight_info")
            assert (info["weight_version"], info["consistent"]) == ("good", False), info
        fresh = make_state(3)
        trainer.send_weights(TensorSource(fresh), weight_version="fresh")
        f.assert_synced(fresh, "fresh")
