"""A failed round closes the trainer's transfer engine, ending every read still under way.

Mooncake cannot cancel a transfer: a worker's read that outlived its round goes on, sharing
the link with the next round's reads, until it ends. So after a failed round the trainer closes
its process's transfer engine (:func:`wtcore_mooncake.te.close`) and the next handshake
announces a fresh one. Real transfer engines over TCP on loopback; the trainer listens on
127.0.0.2 so that its engine is its own, not the one the workers of this process share.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import TransferTimeoutError
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inproc import InProcessClient
from wtcore_mooncake import MooncakeTrainerInitInfo, te

pytestmark = [pytest.mark.timeout(120)]

HOST = "127.0.0.2"  # the trainer's own engine: nothing else in this process uses the address


def _reader() -> Any:
    engine = te.load()()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine


def test_closing_ends_reads_and_then_lets_go_of_what_it_lent() -> None:
    engine, endpoint = te.start(HOST, "tcp")
    reader = _reader()
    src = torch.arange(1 << 16, dtype=torch.int32)
    dst = torch.zeros_like(src)
    n = src.numel() * src.element_size()
    assert reader.register_memory(dst.data_ptr(), n) == 0
    [[address, nbytes]] = te.lender(HOST, "tcp").lend([src]) or [[0, 0]]
    assert reader.transfer_sync_read(endpoint, dst.data_ptr(), address, nbytes) == 0
    assert torch.equal(src, dst)

    alive = weakref.ref(src), weakref.ref(engine)
    del engine, src
    te.close(HOST, "tcp")
    assert all(ref() is None for ref in alive), "kept after its engine closed"
    # Nothing answers at the old endpoint any more: a read fails at once, not after 30 s.
    assert reader.transfer_sync_read(endpoint, dst.data_ptr(), address, nbytes) != 0

    fresh, endpoint2 = te.start(HOST, "tcp")
    again = torch.arange(10, dtype=torch.int32)
    assert fresh.register_memory(again.data_ptr(), 40) == 0
    assert reader.transfer_sync_read(endpoint2, dst.data_ptr(), again.data_ptr(), 40) == 0
    assert torch.equal(dst[:10], again)
    fresh.unregister_memory(again.data_ptr())
    reader.unregister_memory(dst.data_ptr())


def test_an_engine_held_elsewhere_in_the_process_stays_open() -> None:
    engine, endpoint = te.start(HOST, "tcp")  # held here, as a worker engine would hold it
    te.close(HOST, "tcp")
    assert te.start(HOST, "tcp") == (engine, endpoint)


class FailingOnce(InProcessClient):
    """The in-process client, whose first bucket update fails as a stalled worker's would."""

    failed = False

    def update_weights(self, update_info: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise TransferTimeoutError("the worker stalled")
        return super().update_weights(update_info, *args, **kwargs)


@pytest.mark.parametrize("source_reads", [True, False], ids=["source-reads", "slots"])
def test_after_a_failed_round_the_next_one_reads_from_a_fresh_engine(source_reads: bool) -> None:
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(64, 8 + i, generator=g) for i in range(5)}
    model = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    client = FailingOnce(worker, timeout_s=30)
    info = MooncakeTrainerInitInfo(
        address=HOST, timeout_s=30, rank=0, packed_buffer_size_bytes=4096,
        source_reads=source_reads,
    )  # fmt: skip
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    )
    try:
        first = weakref.ref(te.start(HOST, "tcp")[0])
        with pytest.raises(TransferTimeoutError, match="stalled"):
            trainer.send_weights(weight_version="v0")
        assert trainer.endpoint == "" and first() is None  # closed, and forgotten
        trainer.send_weights(weight_version="v1")
        assert trainer.endpoint
        assert_state_equal(model, state)
        assert worker.weight_info()["consistent"] is True
    finally:
        trainer.shutdown()
        worker.shutdown()
