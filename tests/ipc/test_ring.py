"""How the ipc ring cuts a bucket into slot-sized chunks, and how a failed round ends it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink
from wtcore.source import TensorSource
from wtcore.testing.sources import build_module, zeros_like_state
from wtcore.worker import WeightSyncWorker
from wtcore_ipc import IPCTrainerInitInfo
from wtcore_ipc.ring import chunks
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
