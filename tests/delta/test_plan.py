"""The delta layer learns a round's kind from its first announcement (``DeltaSink.plan``).

A delta round's header is its first tensor. A round whose first announced tensor is anything
else is a full round, so the layer offers the sink's tensors from the first one on: an engine
receives the round's first tensor in place instead of staging it in fresh memory and copying
it. A round announced as full that then loads a header is refused, nothing of it applied.
The last two tests run real ipc rounds (shared memory, in this process) through a worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.meta import ParamMeta
from wtcore.sink import ModuleSink
from wtcore.source import TensorSource
from wtcore.testing.delta import assert_bits_equal
from wtcore.testing.sources import build_module, zeros_like_state
from wtcore.worker import WeightSyncWorker
from wtcore_delta.header import HEADER_NAME, DeltaHeader, new_lineage
from wtcore_delta.receiver import DeltaSink
from wtcore_ipc import IPCTrainerInitInfo, share_weights
from wtcore_kit.inproc import InProcessClient


class _Recording(ModuleSink):
    """A module sink that records what it is asked: offers and loads (and a ``plan`` of its
    own, which only receiver layers are called with)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(build_module(zeros_like_state(state)))
        self.loaded: list[str] = []
        self.offered: list[str] = []
        self.planned: list[list[str]] = []

    def destination(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        t = super().destination(name, dtype, shape)
        if t is not None:
            self.offered.append(name)
        return t

    def load_weights(self, weights: Any) -> None:
        batch = list(weights)
        self.loaded.extend(n for n, _ in batch)
        super().load_weights(batch)

    def plan(self, metas: Any) -> None:
        self.planned.append([getattr(m, "name", m) for m in metas or []])


def _meta(name: str, t: torch.Tensor) -> ParamMeta:
    return ParamMeta.of(name, t)


def _layer(state: dict[str, torch.Tensor]) -> tuple[DeltaSink, _Recording]:
    sink = _Recording(state)
    return DeltaSink(sink, readable=sink, in_place=sink.patch_targets(), accepts=True), sink


STATE = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}


def test_a_round_announced_without_a_header_is_offered_from_its_first_tensor() -> None:
    layer, sink = _layer(STATE)
    layer.begin(None, False)
    assert layer.destination("a", torch.float32, (6,)) is None, "nothing known yet"
    layer.plan([_meta("a", STATE["a"]), _meta("b", STATE["b"])])
    dest = layer.destination("a", torch.float32, (6,))
    assert dest is not None and dest.data_ptr() == sink.patch_targets()["a"].data_ptr()
    assert layer.applied, "the engine writes into the chain's tensor from now on"
    layer.begin("v1", True)
    assert layer.destination("a", torch.float32, (6,)) is None, "a new round knows nothing"


def test_a_round_announced_with_its_header_first_offers_nothing_before_the_header() -> None:
    layer, sink = _layer(STATE)
    header = DeltaHeader(None, {}, lineage=new_lineage()).to_tensor()  # a full round's
    layer.begin(None, False)
    layer.plan([_meta(HEADER_NAME, header), _meta("a", STATE["a"])])
    assert layer.destination("a", torch.float32, (6,)) is None
    assert layer.destination(HEADER_NAME, header.dtype, tuple(header.shape)) is None
    layer.load_weights([(HEADER_NAME, header)])
    assert layer.destination("a", torch.float32, (6,)) is not None, "the header said: full"
    assert sink.loaded == [], "the header never reaches the sink"


@pytest.mark.parametrize("metas", [[], None, ["not a meta"]])
def test_an_announcement_that_names_no_first_tensor_decides_nothing(metas: Any) -> None:
    layer, _ = _layer(STATE)
    layer.begin(None, False)
    layer.plan(metas)
    layer.plan([_meta("a", STATE["a"])])  # a later announcement of the same round counts
    assert layer.destination("a", torch.float32, (6,)) is not None


def test_only_the_round_s_first_announcement_decides() -> None:
    layer, _ = _layer(STATE)
    header = DeltaHeader(None, {}, lineage=new_lineage()).to_tensor()
    layer.begin(None, False)
    layer.plan([_meta(HEADER_NAME, header)])
    layer.plan([_meta("a", STATE["a"])])  # the second bucket of the round
    assert layer.destination("a", torch.float32, (6,)) is None


def test_a_header_loaded_into_a_round_announced_without_one_is_refused() -> None:
    """The trainer announced a full round and then sent a header first: it may not open a
    delta round over tensors already written in place, and nothing of its batch lands."""
    layer, sink = _layer(STATE)
    header = DeltaHeader(None, {}, lineage=new_lineage()).to_tensor()
    layer.begin(None, False)
    layer.plan([_meta("a", STATE["a"]), _meta(HEADER_NAME, header)])
    with pytest.raises(PayloadError, match="may only be the first tensor of a round"):
        layer.load_weights([(HEADER_NAME, header), ("b", torch.zeros(3, dtype=torch.bfloat16))])
    assert sink.loaded == [] and not layer.delta_round


@contextmanager
def _ipc_pair(
    state: dict[str, torch.Tensor], sink: ModuleSink, *, delta: bool = False
) -> Iterator[tuple[Any, WeightSyncWorker]]:
    worker = WeightSyncWorker("ipc", sink, rank=0, world_size=1)
    assert isinstance(worker.engine.sink.inner, DeltaSink), "the delta layer is in the chain"
    info = IPCTrainerInitInfo(packed_buffer_size_bytes=1 << 18, timeout_s=30, rank=0, delta=delta)
    trainer = None
    try:
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=InProcessClient([worker], timeout_s=30), source=TensorSource(state)
        )
        yield trainer, worker
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("shared", [False, True], ids=["ring", "shared_weights"])
def test_a_full_round_lands_every_tensor_in_place(shared: bool) -> None:
    """Before, the round's first tensor was staged in fresh memory and loaded through the
    sink (a copy) every round, because the delta layer offered nothing before a batch."""
    gen = torch.Generator().manual_seed(7)
    state = {f"w{i}": torch.randn(128, 128, generator=gen) for i in range(6)}  # 64 KiB each
    sink = _Recording(state)
    with share_weights(state) if shared else nullcontext(), _ipc_pair(state, sink) as (trainer, _):
        for r in range(2):
            for t in state.values():
                t.add_(1)
            sink.loaded, sink.offered = [], []
            trainer.send_weights(weight_version=f"v{r}")
            assert sink.loaded == [], "nothing staged and copied"
            assert sink.offered == list(state), "every tensor received in place, in order"
            assert_bits_equal(dict(sink.named_tensors()), state)


def test_delta_rounds_still_open_with_their_header() -> None:
    """A delta trainer's rounds announce the header first: the first round is full (its
    header names the lineage), the next a delta round, each bit-exact."""
    gen = torch.Generator().manual_seed(8)
    state = {f"w{i}": torch.randn(64, 64, generator=gen).to(torch.bfloat16) for i in range(3)}
    sink = _Recording(state)
    with _ipc_pair(state, sink, delta=True) as (trainer, worker):
        trainer.send_weights(weight_version="v1")
        assert sink.planned == [], "the user's sink is never asked to plan"
        state["w1"][0, :4] += 1
        stats = trainer.send_weights(weight_version="v2")
        assert stats.num_bytes < sum(t.nbytes for t in state.values()), "a delta round"
        assert_bits_equal(dict(sink.named_tensors()), state)
        info = worker.weight_info()
        assert (info["weight_version"], info["consistent"]) == ("v2", True)
