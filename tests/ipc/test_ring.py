"""How the ipc ring cuts a bucket into slot-sized chunks, and how a failed round ends it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore.errors import TransferError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.rounds import drop_round
from wtcore.sink import ModuleSink
from wtcore.source import TensorSource
from wtcore.testing.sources import build_module, zeros_like_state
from wtcore.worker import WeightSyncWorker
from wtcore_ipc import IPCTrainerInitInfo
from wtcore_ipc.ring import chunks
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.inproc import InProcessClient


@pytest.mark.parametrize(
    ("nbytes", "slot", "expected"),
    [
        (0, 16, [(0, 0)]),  # an empty bucket is one empty chunk
        (16, 16, [(0, 16)]),
        (40, 16, [(0, 16), (16, 16), (32, 8)]),
        (48, 16, [(0, 16), (16, 16), (32, 16)]),
    ],
)
def test_a_bucket_is_cut_into_slot_sized_chunks(
    nbytes: int, slot: int, expected: list[tuple[int, int]]
) -> None:
    assert chunks(nbytes, slot) == expected


class _BreaksMidRound(TensorSource):
    """A source whose pass fails after ``after`` tensors: a trainer-side failure mid-round."""

    def __init__(self, state: dict[str, torch.Tensor], after: int) -> None:
        super().__init__(state)
        self.after = after

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().__iter__()):
            if i == self.after:
                raise RuntimeError("the source broke mid-round")
            yield item


def test_a_failed_round_cancels_the_ring_before_the_trainer_waits() -> None:
    """The kit's ``abandon_round`` hook stamps the cancel mark in the next slot before the
    trainer waits for its call: the worker gives up at once, not at its 30 s timeout."""
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(20)}  # a bucket each
    worker = WeightSyncWorker("ipc", ModuleSink(build_module(zeros_like_state(state))))
    info = IPCTrainerInitInfo(
        packed_buffer_size_bytes=4096, share_weights=False, timeout_s=30, rank=0
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=InProcessClient([worker], timeout_s=30)
    )
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="the source broke mid-round"):
            trainer.send_weights(_BreaksMidRound(state, after=10))
        assert time.monotonic() - start < 10, "the worker waited for its timeout"
        assert trainer.segment_name is None, "the failed round freed the ring"
    finally:
        trainer.shutdown()
        worker.shutdown()


class _SlowSink(ModuleSink):
    """Counts the batches it loaded, each after a short sleep; raises at batch ``fail_at``."""

    def __init__(self, module: torch.nn.Module, fail_at: int = -1) -> None:
        super().__init__(module)
        self.loads, self.fail_at = 0, fail_at

    def load_weights(self, weights: Any) -> None:
        time.sleep(0.02)
        if self.loads == self.fail_at:
            raise RuntimeError(f"the sink refused batch {self.loads}")
        super().load_weights(weights)
        self.loads += 1


class _ReturnsFirst(InProcessClient):
    """Returns from the ring's update at once and receives on a thread, as vLLM's adapter does
    in a staged round (``receives_after_return``); the finish waits for that receive."""

    def __init__(self, worker: WeightSyncWorker, sink: _SlowSink) -> None:
        super().__init__([worker], timeout_s=30)
        self.sink, self.receiving = sink, list[BackgroundCall[Any]]()
        self.loads_at_finish = -1

    def update_weights(self, update_info: Any) -> None:
        engine = self.workers[0].engine
        assert engine.receives_after_return(engine.parse_update_info(drop_round(update_info)))
        call = BackgroundCall(super().update_weights, update_info, name="receive")
        self.receiving.append(call)

    def finish_weight_update(self, *args: Any, **kwargs: Any) -> Any:
        self.loads_at_finish = self.sink.loads  # before this waits for the receive
        for call in self.receiving:
            call.result(30)
        return super().finish_weight_update(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [-1, 10])
def test_a_worker_that_returns_first_still_ends_the_round_with_its_last_chunk(
    fail_at: int,
) -> None:
    """A worker may return from the ring's update at once and receive on a thread: the
    trainer's round ends only once that worker consumed its last chunk, and a receive that
    fails there fails the round at once, naming the rank, not at the 30 s timeout (one whose
    process dies: tests/ipc/test_processes.py)."""
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(20)}  # a bucket each
    sink = _SlowSink(build_module(zeros_like_state(state)), fail_at)
    worker = WeightSyncWorker("ipc", sink)
    client = _ReturnsFirst(worker, sink)
    info = IPCTrainerInitInfo(
        packed_buffer_size_bytes=4096, share_weights=False, timeout_s=30, rank=0
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
    try:
        if fail_at < 0:
            trainer.send_weights(TensorSource(state))
            assert client.loads_at_finish == len(state), "the round ended before the receive"
            for name, t in sink.named_tensors():
                assert torch.equal(t, state[name]), name
            return
        start = time.monotonic()
        with pytest.raises(TransferError, match="receiver rank 0 gave up the round"):
            trainer.send_weights(TensorSource(state))
        assert time.monotonic() - start < 10, "the trainer waited for its timeout"
        (call,) = client.receiving
        with pytest.raises(RuntimeError, match="the sink refused batch 10"):
            call.result(30)
    finally:
        trainer.shutdown()
        worker.shutdown()
