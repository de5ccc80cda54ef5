"""The rendezvous store: it listens where ``master_address`` says, and strangers cannot join.

Real worker processes on a real gloo group; the rogue is a plain ``TCPStore`` client of the
trainer's store, as anyone who can reach the port could be.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.nccl.nccl_e2e_kit import Fleet, fleet, loopback_info, make_state
from wtcore import PayloadError, TensorSource, WeightTransferTrainerFactory
from wtcore.testing import MismatchedSource, free_port, spec_of
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_nccl.group import GENERATION_KEY

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

TIMEOUT_S = 20.0


def _info(port: int) -> NCCLTrainerInitInfo:
    return loopback_info(
        world_size=3,
        master_port=port,
        packed_buffer_size_bytes=4 << 10,
        timeout_s=TIMEOUT_S,
        torch_num_threads=1,
    )


@pytest.fixture(scope="module")
def two() -> Iterator[Fleet]:
    with fleet(2, spec_of(make_state(0)), timeout_s=2 * TIMEOUT_S) as f:
        yield f


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as the kernel writes them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


def test_store_listens_on_master_address_only(two: Fleet) -> None:
    port = free_port()
    with WeightTransferTrainerFactory.trainer_init(_info(port), client=two.client):
        assert _listeners(port) == ["0100007F"]  # 127.0.0.1, not every interface


def test_a_rogue_store_client_cannot_join_or_break_the_group(two: Fleet) -> None:
    port = free_port()
    with WeightTransferTrainerFactory.trainer_init(_info(port), client=two.client) as trainer:
        trainer.send_weights(TensorSource(make_state(1)), weight_version="v1")
        # A stranger reaches the store and pre-registers every rank of the next handshakes
        # under every key it can know of.
        rogue = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10)
        )
        now = int(rogue.add(GENERATION_KEY, 0))
        for generation in range(now + 1, now + 16):
            for rank in range(3):
                rogue.add(f"wtcore/nccl/g{generation}//arrived/{rank}", 1)  # PrefixStore adds "/"
        # A failed round forces a new handshake while the rogue's keys are in the store.
        with pytest.raises(PayloadError, match="metadata"):
            trainer.send_weights(
                MismatchedSource(TensorSource(make_state(2)), "reshaped"), weight_version="bad"
            )
        fresh = make_state(3)
        trainer.send_weights(TensorSource(fresh), weight_version="fresh")
        two.assert_synced(fresh, "fresh")
        del rogue
