"""Large tensors travel in place: sent from the source's storage, received into the model.

Trainer and workers share this process (workers on threads, a real gloo group, or tcp's
streams, whose messages take a bucket in parts). A tensor of
at least ``direct_min_bytes`` is a bucket of its own; the sender broadcasts it straight from
the source tensor and the receiver straight into the tensor its sink offers
(``DirectSink.destination``). These tests check that this happens (the sink's
``load_weights`` never sees those tensors, the trainer and receiver hold no buffer for them)
and that everything that must stay staged does: sinks without ``destination``, transactional
workers, checksummed rounds, offers that do not fit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.nccl.nccl_e2e_kit import loopback_info
from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import PayloadError
from wtcore.sink import DirectSink, direct_destination
from wtcore.source import WeightSource
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore.trainer import TrainerInitInfo
from wtcore_kit.inproc import InProcessClient
from wtcore_tcp import TCPTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TIMEOUT_S = 30.0
#: Tensors of at least this many bytes travel in place in these tests.
DIRECT = 4096


def _state(seed: int) -> dict[str, torch.Tensor]:
    """Large tensors (in place) between small ones (packed), mixed dtypes, an empty one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.small": torch.randn(10, generator=g),
        "a.big": torch.randn(64, 33, generator=g),  # 8448 bytes
        "b.bf16": torch.randn(4096, generator=g).to(torch.bfloat16),  # 8192 bytes
        "b.tiny": torch.randint(0, 100, (3,), generator=g),
        "c.empty": torch.zeros(0),
        "c.big": torch.randn(40, 40, generator=g),  # 6400 bytes
        "d.small": torch.randn(7, generator=g).to(torch.float16),
    }


BIG = ("a.big", "b.bf16", "c.big")
#: Those received in place: the worker's first ``packed_num_buffers`` buckets of a round are
#: posted before its first batch told the delta sink that this is not a delta round.
IN_PLACE = ("b.bf16", "c.big")


class RecordingSink(ModuleSink):
    """A module sink that records what passed through ``load_weights`` and what was offered."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.loaded: list[str] = []
        self.offered: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        self.loaded += [n for n, _ in batch]
        super().load_weights(batch)

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        t = super().destination(name, dtype, shape)
        if t is not None:
            self.offered.append(name)
        return t


class PlainSink:
    """A sink with ``load_weights`` and ``named_tensors`` only (no ``destination``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.inner = ModuleSink(module)
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        self.loaded += [n for n, _ in batch]
        self.inner.load_weights(batch)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.inner.named_tensors()


class BadOfferSink(RecordingSink):
    """Offers a tensor that does not fit (one element more, another dtype, non-contiguous)."""

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        t = self._targets[name]
        self.offered.append(name)
        bad = [
            torch.empty(t.numel() + 1, dtype=t.dtype),
            torch.empty(t.shape, dtype=torch.int8),
            torch.empty((*t.shape, 2), dtype=t.dtype)[..., 0],
        ]
        return bad[len(self.offered) % len(bad)]


def _info(
    *, packed: bool = True, checksum: bool = False, buffer: int = 1024, backend: str = "nccl"
) -> TrainerInitInfo:
    common = {
        "packed": packed,
        "packed_buffer_size_bytes": buffer,
        "direct_min_bytes": DIRECT,
        "checksum": checksum,
        "timeout_s": TIMEOUT_S,
    }
    if backend == "tcp":  # the chain's streams (one hop)
        return TCPTrainerInitInfo(
            address="127.0.0.1", world_size=2, topology="chain", rank=0, **common
        )
    return loopback_info(world_size=2, **common)


@contextmanager
def _pair(
    state: dict[str, torch.Tensor],
    sink_cls: Any = RecordingSink,
    *,
    transactional: bool = False,
    **info: Any,
) -> Iterator[tuple[Any, WeightSyncWorker, torch.nn.Module, Any]]:
    module = build_module(zeros_like_state(state))
    sink = sink_cls(module)
    worker = WeightSyncWorker(info.get("backend", "nccl"), sink, transactional=transactional)
    client = InProcessClient([worker], timeout_s=TIMEOUT_S)
    trainer = WeightTransferTrainerFactory.trainer_init(
        _info(**info), client=client, source=TensorSource(state)
    )
    try:
        yield trainer, worker, module, sink
    finally:
        trainer.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("backend", ["tcp", "nccl"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_large_tensors_travel_in_place_and_small_ones_packed(packed: bool, backend: str) -> None:
    state = _state(1)
    with _pair(state, packed=packed, backend=backend) as (trainer, worker, module, sink):
        ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
        for r in range(3):
            state = _state(10 + r)
            sink.loaded.clear()
            trainer.send_weights(TensorSource(state), weight_version=f"v{r}")
            assert_state_equal(module, state)
            # The receiver wrote the large tensors into the parameters themselves.
            assert not set(IN_PLACE) & set(sink.loaded), sink.loaded
            if packed and backend == "nccl":  # a bucket of two, staged: gloo's
                assert {"b.tiny", "c.empty"} <= set(sink.loaded)  # messages are one tensor
            if packed and backend == "tcp":  # the chain's streams take it in parts,
                assert not {"b.tiny", "c.empty"} & set(sink.loaded)  # into the module too
        assert {n: p.data_ptr() for n, p in module.named_parameters()} == ptrs
        assert worker.weight_info()["consistent"] is True
        # The trainer holds buffers for the small buckets only; the receiver at most that plus
        # the largest tensor (buffer x num_buffers + largest tensor).
        small = 1024 * 2
        assert trainer._pool.nbytes() <= small
        if backend == "tcp":  # the streams send every bucket from the source's tensors
            assert trainer._pool.nbytes() == 0
        assert worker.engine._pool.nbytes() <= small + 64 * 33 * 4  # type: ignore[attr-defined]


class RefusesOneSink(RecordingSink):
    """Offers every tensor but ``refused`` (a sink that keeps one of them its own way)."""

    refused = "b.tiny"

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        return None if name == self.refused else super().destination(name, dtype, shape)


class RefusesSecondSink(RefusesOneSink):
    refused = "b.more"


def _state_with_more(seed: int) -> dict[str, torch.Tensor]:
    """:func:`_state` with a second small tensor in ``b.tiny``'s bucket, after it."""
    state = _state(seed)
    more = torch.randn(6, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    names = list(state)
    at = names.index("b.tiny") + 1
    return {n: state[n] for n in names[:at]} | {"b.more": more} | {n: state[n] for n in names[at:]}


@pytest.mark.parametrize("sink_cls", [RefusesOneSink, RefusesSecondSink], ids=["first", "second"])
def test_a_bucket_in_parts_whose_sink_refuses_one_tensor_loads_that_one_and_counts_each_once(
    sink_cls: type[RefusesOneSink],
) -> None:
    """The chain's streams take the bucket of ``b.tiny``, ``b.more`` and ``c.empty`` in parts.
    A sink that refuses its first tensor gets the whole bucket staged; one that refuses a later
    tensor (after the first was offered, and counted as landed) gets that one loaded from
    memory of its own: either way the round is bit-exact and every announced byte lands once."""
    state = _state_with_more(8)
    with _pair(state, sink_cls, backend="tcp") as (trainer, worker, module, sink):
        for r in range(2):
            state = _state_with_more(20 + r)
            sink.loaded.clear()
            trainer.send_weights(TensorSource(state), weight_version=f"v{r}")
            assert_state_equal(module, state)
            bucket = {"b.tiny", "b.more", "c.empty"}
            staged = {"b.more"} if sink.refused == "b.more" else bucket
            assert bucket & set(sink.loaded) == staged, sink.loaded
            info = worker.weight_info()
            assert info["consistent"] is True
            planned = sum(t.numel() * t.element_size() for t in state.values())
            assert info["round_bytes"] == {"planned": planned, "landed": planned}


def test_a_non_contiguous_source_tensor_is_bit_exact() -> None:
    state = _state(2)
    state["c.big"] = torch.randn(40, 40).t()  # non-contiguous in the source
    assert not state["c.big"].is_contiguous()
    with _pair(state) as (trainer, _worker, module, sink):
        trainer.send_weights(weight_version="v1")
        assert_state_equal(module, state)
        assert "c.big" not in sink.loaded


def test_a_sink_without_destination_gets_every_tensor_through_load_weights() -> None:
    state = _state(3)
    with _pair(state, PlainSink) as (trainer, _worker, module, sink):
        trainer.send_weights(weight_version="v1")
        assert_state_equal(module, state)
        assert set(BIG) <= set(sink.loaded)


def test_an_offer_that_does_not_fit_is_refused_and_the_tensor_staged() -> None:
    state = _state(4)
    with _pair(state, BadOfferSink) as (trainer, worker, module, sink):
        trainer.send_weights(weight_version="v1")
        assert_state_equal(module, state)
        assert set(IN_PLACE) <= set(sink.offered)
        assert set(BIG) <= set(sink.loaded)
        assert worker.weight_info()["consistent"] is True


def test_checksummed_rounds_stage_every_bucket() -> None:
    state = _state(5)
    with _pair(state, checksum=True) as (trainer, _worker, module, sink):
        trainer.send_weights(weight_version="v1")
        assert_state_equal(module, state)
        assert set(BIG) <= set(sink.loaded)


class _BreaksAfter(WeightSource):
    """Yields ``inner``'s first ``n`` tensors, then one of a wrong shape."""

    def __init__(self, inner: dict[str, torch.Tensor], n: int) -> None:
        self.inner, self.n = inner, n

    def metadata(self) -> list[Any]:
        return TensorSource(self.inner).metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, t) in enumerate(self.inner.items()):
            yield (name, t) if i < self.n else (name, t.reshape(-1)[:1])


def test_transactional_workers_stage_and_a_failed_round_leaves_the_model_untouched() -> None:
    old = _state(6)
    with _pair(old, transactional=True) as (trainer, worker, module, sink):
        trainer.send_weights(weight_version="v1")
        assert_state_equal(module, old)
        # The round breaks after the first large tensors went out: nothing was applied.
        new = _state(7)
        with pytest.raises(PayloadError, match="metadata"):
            trainer.send_weights(_BreaksAfter(new, n=5), weight_version="v2")
        assert_state_equal(module, old)
        assert sink.offered == []
        trainer.send_weights(TensorSource(new), weight_version="v3")
        assert_state_equal(module, new)
        assert (worker.weight_info()["weight_version"], worker.weight_info()["consistent"]) == (
            "v3",
            True,
        )


def test_direct_destination_checks_the_offer() -> None:
    module = build_module({"w": torch.zeros(4, 4), "h": torch.zeros(4, 4).t()})
    sink = ModuleSink(module)
    assert isinstance(sink, DirectSink)
    got = direct_destination(sink, "w", torch.float32, (4, 4), "cpu")
    assert (
        got is not None
        and got.data_ptr() == module.get_parameter("w").data_ptr()
        and not got.requires_grad
    )
    assert direct_destination(sink, "w", torch.float16, (4, 4), "cpu") is None  # dtype
    assert direct_destination(sink, "w", torch.float32, (16,), "cpu") is None  # shape
    assert direct_destination(sink, "h", torch.float32, (4, 4), "cpu") is None  # layout
    assert direct_destination(sink, "nope", torch.float32, (4, 4), "cpu") is None
    assert direct_destination(PlainSink(module), "w", torch.float32, (4, 4), "cpu") is None

    class Overrides(ModuleSink):  # changed load_weights: it must see every tensor
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(weights)

    assert direct_destination(Overrides(module), "w", torch.float32, (4, 4), "cpu") is None


class _SourceStarted(TensorSource):
    """Sets ``started`` when the trainer begins reading it."""

    def __init__(self, state: dict[str, torch.Tensor], started: threading.Event) -> None:
        super().__init__(state)
        self.started = started

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.started.set()
        yield from super().__iter__()


class _StartWaitsForTheSource(InProcessClient):
    """``start_weight_update`` answers only once the trainer reads its source (or after 10 s)."""

    def __init__(self, workers: list[WeightSyncWorker], started: threading.Event) -> None:
        super().__init__(workers, timeout_s=TIMEOUT_S)
        self.started = started
        self.overlapped: list[bool] = []

    def start_weight_update(self) -> None:
        self.overlapped.append(self.started.wait(10))
        super().start_weight_update()


def test_the_start_round_trip_overlaps_reading_the_first_bucket() -> None:
    """The trainer reads (and packs) the first bucket while ``start_weight_update`` is out."""
    state = _state(8)
    module = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("nccl", ModuleSink(module))
    started = threading.Event()
    client = _StartWaitsForTheSource([worker], started)
    trainer = WeightTransferTrainerFactory.trainer_init(_info(), client=client)
    try:
        for r in range(2):
            started.clear()
            state = _state(20 + r)
            trainer.send_weights(_SourceStarted(state, started), weight_version=f"v{r}")
            assert_state_equal(module, state)
        assert client.overlapped == [True, True]
    finally:
        trainer.shutdown()
        worker.shutdown()
