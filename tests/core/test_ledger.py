"""Per-tensor byte accounting: a round in which an engine skipped a tensor is never published.

The engine below is the ``inline`` engine except that it silently drops one tensor of every
batch (a buggy or lying engine that answers 200 while moving nothing for it). The worker's
ledger counts what the engine delivered against what each update announced, and fails the
finish naming the tensor; nothing is published.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore import ENGINES, ReceiverError, TensorSource, WeightSyncWorker
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink
from wtcore.testing.sources import build_module, mixed_dtype_state, zeros_like_state
from wtcore_kit.inline import InlineTrainerInitInfo, InlineUpdateInfo, InlineWorkerEngine
from wtcore_kit.inproc import InProcessClient

NAME = "test-skipping"


class SkippingEngine(InlineWorkerEngine):
    """``inline``, but the tensor named :attr:`skip` never reaches the sink."""

    skip: str | None = None

    def receive_weights(self, update_info: InlineUpdateInfo) -> None:
        real, skip = self.sink, SkippingEngine.skip

        class Dropping:
            def load_weights(self, weights: Any) -> None:
                real.load_weights([(n, t) for n, t in weights if n != skip])

        self.sink = Dropping()  # type: ignore[assignment]
        try:
            super().receive_weights(update_info)
        finally:
            self.sink = real


@pytest.fixture()
def worker() -> Iterator[tuple[WeightSyncWorker, dict[str, torch.Tensor]]]:
    ENGINES.register(NAME, SkippingEngine, replace=True)
    state = mixed_dtype_state(seed=4)
    w = WeightSyncWorker(NAME, ModuleSink(build_module(zeros_like_state(state))))
    try:
        yield w, state
    finally:
        w.shutdown()
        SkippingEngine.skip = None
        ENGINES.unregister(NAME)


def _trainer(w: WeightSyncWorker, state: dict[str, torch.Tensor]) -> Any:
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=1 << 20)
    client = InProcessClient([w], timeout_s=30)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    )


def test_every_byte_counted_in_a_good_round(worker: Any) -> None:
    w, state = worker
    model = sum(t.numel() * t.element_size() for t in state.values())
    with _trainer(w, state) as trainer:
        stats = trainer.send_weights(weight_version="v1", verify=True)
    assert w.weight_info()["round_bytes"] == {"planned": model, "landed": model}
    assert stats.bytes_landed == [model]


def test_a_skipped_tensor_fails_the_round_naming_it(worker: Any) -> None:
    w, state = worker
    with _trainer(w, state) as trainer:
        trainer.send_weights(weight_version="v1")
        skipped = sorted(state)[1]
        SkippingEngine.skip = skipped
        for t in state.values():
            t.copy_(torch.ones_like(t))
        with pytest.raises(ReceiverError, match="fewer bytes than planned") as err:
            trainer.send_weights(weight_version="v2")
    nbytes = state[skipped].numel() * state[skipped].element_size()
    assert f"{skipped!r} (0 of {nbytes} bytes)" in str(err.value)
    info = w.weight_info()
    assert (info["weight_version"], info["consistent"]) == ("v1", False)
    assert info["rounds_failed"] == 1 and "fewer bytes than planned" in info["last_error"]
    got = info["round_bytes"]
    assert got["planned"] - got["landed"] == nbytes


def test_each_announcement_reaches_the_layers_that_plan_and_no_other_sink() -> None:
    """A receiver layer (wtcore-delta's) learns what each update announces before any of it
    lands; a layer without ``plan`` is skipped, and a sink that merely has a method of that
    name (the user's, behind the layers) is never called; the ledger still counts."""
    from wtcore.ledger import ByteLedger
    from wtcore.meta import ParamMeta

    class Planning:
        def __init__(self) -> None:
            self.plans: list[object] = []

        def load_weights(self, weights: Any) -> None:
            raise AssertionError("nothing loaded in this test")

        def plan(self, metas: object) -> None:
            self.plans.append(metas)

    metas = [ParamMeta("a", torch.float32, (2, 3))]
    users, first, second = Planning(), Planning(), Planning()
    ledger = ByteLedger(users, [first, object(), second])
    ledger.plan(metas)
    ledger.plan(None)  # an engine that announces nothing: passed on as it is
    assert first.plans == second.plans == [metas, None]
    assert users.plans == [], "only layers are asked"
    assert ledger.planned == {"a": 24}
