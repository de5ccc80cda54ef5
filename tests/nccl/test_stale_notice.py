"""An abort notice read during one round must not fail the next.

A receiver asks its channel, while it waits, whether the sender gave up (the abort notice),
on a helper thread (the kit's receiving loop, :mod:`wtcore_channel`). With two workers, a sender that fails on one
worker may already have sent the other everything: that worker finishes its round, and its
last question comes back afterwards with the failed round's reason. The next round, on a
new group, must not report that reason as its own (seen in the multi-node fault tests as a
recovery round failing with "the trainer abandoned the round" about the round before).

The late answer is put in place directly (it depends on thread timing otherwise); the next
round is real, and its source waits before its first tensor so that the receiver polls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from tests.nccl.nccl_e2e_kit import loopback_info
from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.testing import build_module
from wtcore.trainer import TrainerInitInfo
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.inproc import InProcessClient
from wtcore_tcp import TCPTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TIMEOUT_S = 30.0


class _SlowStart(TensorSource):
    """Yields its first tensor only after a pause, so the receiver waits (and polls)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        time.sleep(0.6)
        yield from super().__iter__()


def channel_info(backend: str) -> TrainerInitInfo:
    """A one-worker trainer on loopback: nccl's collective, or tcp's streams."""
    if backend == "tcp":
        return TCPTrainerInitInfo(
            address="127.0.0.1", world_size=2, direct_min_bytes=1024, timeout_s=TIMEOUT_S, rank=0
        )
    return loopback_info(
        world_size=2, direct_min_bytes=1024, timeout_s=TIMEOUT_S, broadcast="collective"
    )


@pytest.mark.parametrize("backend", ["nccl", "tcp"])
def test_a_late_abort_notice_of_a_finished_round_does_not_fail_the_next(backend: str) -> None:
    shapes = {"a": (64, 64), "b": (128,), "c": (32, 32)}
    module = build_module({n: torch.zeros(s) for n, s in shapes.items()})
    worker = WeightSyncWorker(backend, ModuleSink(module))
    info = channel_info(backend)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=InProcessClient(worker, timeout_s=TIMEOUT_S)
    )
    try:
        first = {n: torch.randn(s) for n, s in shapes.items()}
        trainer.send_weights(TensorSource(first), weight_version="v1")
        # The answer to the first round's last question, come back after it ended.
        late = BackgroundCall(lambda: "TransferError: the round before failed on rank 2")
        late.result(5.0)
        worker.engine._notice = late  # type: ignore[attr-defined]
        second = {n: torch.randn(s) for n, s in shapes.items()}
        trainer.send_weights(_SlowStart(second), weight_version="v2")
        for name, want in second.items():
            assert torch.equal(module.get_parameter(name).detach(), want), name
        got = worker.weight_info()
        assert (got["weight_version"], got["consistent"]) == ("v2", True)
    finally:
        trainer.shutdown()
        worker.shutdown()
