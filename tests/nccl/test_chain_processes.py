"""The forwarding broadcast (``broadcast="chain"``) on loopback: 3 worker processes, real gloo.

Rank 1 receives from the trainer and forwards to rank 2, which forwards to rank 3; messages
larger than a chunk travel as several chunks, relayed while the next one arrives. After every
round each worker holds the trainer's weights bit for bit, packed and unpacked, across
buffer sizes and a re-handshake. (The namespaced version, with a relay that dies, is in
tests/multinode/test_chain.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.nccl.nccl_e2e_kit import fleet, groups_on_threads, loopback_info, make_state
from wtcore import PayloadError, TensorSource, WeightTransferTrainerFactory
from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing import spec_of
from wtcore_channel.pipeline import wait_work
from wtcore_nccl import NCCLInitInfo, NCCLTrainerInitInfo
from wtcore_nccl.chain import CHUNK_BYTES

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

#: A float32 tensor of 2.5 chunks: several chunks per message, the last one short.
BIG_NUMEL = CHUNK_BYTES * 5 // 8


def _info(workers: int, **kw: object) -> NCCLTrainerInitInfo:
    return loopback_info(
        world_size=1 + workers,
        timeout_s=20.0,
        torch_num_threads=1,
        broadcast="chain",
        **kw,
    )


def test_chain_rounds_bit_exact_over_three_workers() -> None:
    workers = 3
    state0 = make_state(0, big=BIG_NUMEL)
    with fleet(workers, spec_of(state0)) as f:
        seed = 1
        for packed, buffer_size in ((True, 16 << 10), (False, 1 << 30)):
            info = _info(workers, packed=packed, packed_buffer_size_bytes=buffer_size)
            assert info.worker_init_info().broadcast == "chain"
            with WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer:
                for _ in range(2):
                    state = make_state(seed, big=BIG_NUMEL)
                    seed += 1
                    version = f"chain-{packed}-{buffer_size}-{seed}"
                    trainer.send_weights(TensorSource(state), weight_version=version)
                    f.assert_synced(state, version)
                trainer.handshake()  # a new group (new chain) carries on from the same workers
                state = make_state(seed, big=BIG_NUMEL)
                trainer.send_weights(TensorSource(state), weight_version="after-rehandshake")
                f.assert_synced(state, "after-rehandshake")


@pytest.mark.parametrize("cls", [NCCLTrainerInitInfo, NCCLInitInfo])
def test_broadcast_option_is_validated(cls: type) -> None:
    common = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}
    extra = {"rank": 0} if cls is NCCLTrainerInitInfo else {"rank_offset": 1}
    with pytest.raises(PayloadError, match="broadcast: expected .*collective, chain, got"):
        cls(**common, **extra, broadcast="ring")
    info = cls(**common, **extra)
    worker = info.worker_init_info() if cls is NCCLTrainerInitInfo else info
    # One worker: the trainer's auto is the chain (over gloo); a worker init that names no
    # broadcast (a trainer that sends only vLLM's fields) is the collective.
    assert worker.broadcast == ("chain" if cls is NCCLTrainerInitInfo else "collective")


def test_a_stalled_chain_names_the_rank_it_waits_for() -> None:
    """Three ranks on threads of this process (a real store, real streams); rank 0 never
    sends.

    Rank 2 waits on rank 1, which waits on rank 0: each wait that runs out says which rank
    it waits for, and once the streams' own timeout ends the receive, the failure names it
    too, with its address; rank 2's names rank 1.
    """
    world = 3
    with groups_on_threads(world, broadcast="chain", timeout_s=3.0) as groups:
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
def test_a_malformed_chain_address_in_the_store_is_refused_naming_the_rank(published: str) -> None:
    """A chain address is read from the handshake's store and checked before it is used."""
    from wtcore.testing import free_port
    from wtcore_nccl.chain import stream_chain
    from wtcore_nccl.group import host_store

    store = host_store("127.0.0.1", free_port(), 2, 10)
    store.set("chain/0", published)
    with pytest.raises(PayloadError, match="rank 0's chain address in the store is malformed"):
        stream_chain(store, rank=1, world_size=2, host="127.0.0.1", token="t", timeout_s=5)
