"""How an ipc worker copies a round out: shared weights on two threads
(``SegmentReader.read_many``: the bytes shared out evenly, a tensor that straddles the cut cut
in two, every byte where it belongs), and only the first tensor staged where the sink offers
its tensors once it has loaded a batch. Real sealed segments, in this process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink
from wtcore.source import TensorSource
from wtcore.testing.sources import build_module, zeros_like_state
from wtcore.worker import WeightSyncWorker
from wtcore_ipc import IPCTrainerInitInfo, share_weights, shm
from wtcore_ipc.shm import SegmentReader, StagingSegment, _split_bytes
from wtcore_kit.inproc import InProcessClient


def _flat(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("sizes", "parts"),
    [
        ([10, 10, 10, 10], 2),
        ([1000], 2),  # one tensor, cut in two
        ([3, 1000, 5], 2),
        ([7, 0, 9, 1], 3),
        ([1], 2),  # fewer bytes than parts
        ([5, 5], 1),
        ([], 2),
    ],
)
def test_the_reads_are_shared_out_evenly_and_cover_every_byte_once(
    sizes: list[int], parts: int
) -> None:
    outs = [_flat(n) for n in sizes]
    offsets = [1000 * i for i in range(len(sizes))]
    split = _split_bytes(list(zip(offsets, outs, strict=True)), parts)
    total = sum(sizes)
    assert 1 <= len(split) <= max(parts, 1)
    assert all(part for part in split) or total == 0
    share = -(-total // parts) if total else 0
    assert all(sum(o.numel() for _, o in part) <= share for part in split)
    # Every byte of every output, read from the right segment offset, exactly once.
    covered: dict[int, list[int]] = {}
    for part in split:
        for offset, piece in part:
            i = next(k for k, o in enumerate(outs) if o.numel() and _inside(piece, o))
            start = (piece.data_ptr() - outs[i].data_ptr()) // piece.element_size()
            assert offset == offsets[i] + start, "a piece reads from where its bytes are"
            covered.setdefault(i, []).extend(range(start, start + piece.numel()))
    for i, n in enumerate(sizes):
        assert sorted(covered.get(i, [])) == list(range(n))


def _inside(piece: torch.Tensor, whole: torch.Tensor) -> bool:
    lo, hi = whole.data_ptr(), whole.data_ptr() + whole.numel()
    return lo <= piece.data_ptr() and piece.data_ptr() + piece.numel() <= hi


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_many_is_bit_exact_on_any_number_of_threads(threads: int) -> None:
    seg = StagingSegment(3 << 20, 1)
    try:
        data = seg.slot(0)
        data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8))
        at = seg.data_offset(0)
        sizes = [1 << 20, 17, 0, (1 << 20) + 5, 4096]  # one read straddles each cut
        outs, reads, pos = [], [], 0
        for n in sizes:
            out = torch.zeros(n, dtype=torch.uint8)
            outs.append(out)
            reads.append((at + pos, out))
            pos += n + 64
        assert seg.fd is not None
        reader = SegmentReader(seg.name, seg.fd)
        try:
            reader.read_many(reads, threads=threads)
        finally:
            reader.close()
        pos = 0
        for n, out in zip(sizes, outs, strict=True):
            assert torch.equal(out, data[pos : pos + n])
            pos += n + 64
    finally:
        seg.close()


def test_a_read_past_the_segment_copies_nothing() -> None:
    """Every range is checked before the first byte is copied: a hostile offset in the middle
    of a round leaves the earlier outputs untouched too."""
    seg = StagingSegment(1 << 20, 1)
    try:
        seg.slot(0).fill_(7)
        assert seg.fd is not None
        reader = SegmentReader(seg.name, seg.fd)
        try:
            first, bad = torch.zeros(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
            with pytest.raises(PayloadError, match="end past"):
                reader.read_many([(seg.data_offset(0), first), (reader.size - 50, bad)], threads=2)
            assert int(first.max()) == 0 and int(bad.max()) == 0
        finally:
            reader.close()
    finally:
        seg.close()


class _OffersAfterItsFirstLoad(ModuleSink):
    """Offers its tensors only once it has loaded a batch this round, as a delta sink does
    (the first batch tells it whether the round is a delta round)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(build_module(zeros_like_state(state)))
        self.loaded: list[str] = []
        self.offered: list[str] = []

    def new_round(self) -> None:
        self.loaded, self.offered = [], []

    def destination(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        if not self.loaded:
            return None
        self.offered.append(name)
        return super().destination(name, dtype, shape)

    def load_weights(self, weights: Any) -> None:
        batch = list(weights)
        self.loaded.extend(n for n, _ in batch)
        super().load_weights(batch)


@contextmanager
def _pair(state: dict[str, torch.Tensor], sink: ModuleSink) -> Iterator[Any]:
    worker = WeightSyncWorker("ipc", sink, rank=0, world_size=1)
    info = IPCTrainerInitInfo(packed_buffer_size_bytes=1 << 18, timeout_s=30, rank=0)
    trainer = None
    try:
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=InProcessClient([worker], timeout_s=30), source=TensorSource(state)
        )
        yield trainer
    finally:
        if trainer is not None:
            trainer.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("shared", [False, True], ids=["ring", "shared_weights"])
def test_only_the_first_tensor_is_staged_when_the_sink_offers_after_a_load(
    shared: bool,
) -> None:
    """Before, the ring staged its whole first bucket (and shared weights their first 16 MiB)
    in fresh memory every round before such a sink offered anything."""
    gen = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(128, 128, generator=gen) for i in range(8)}  # 64 KiB each
    sink = _OffersAfterItsFirstLoad(state)
    with share_weights(state) if shared else nullcontext(), _pair(state, sink) as trainer:
        for r in range(2):
            for t in state.values():
                t.add_(1)
            sink.new_round()
            trainer.send_weights(weight_version=f"v{r}")
            assert sink.loaded == ["w0"], "the first tensor alone, then the sink's own"
            assert sink.offered == [f"w{i}" for i in range(1, 8)]
            for name, want in state.items():
                assert torch.equal(sink._targets[name], want), name


@pytest.mark.parametrize(
    ("cores", "world_size", "threads"),
    [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 2, 2), (4, 3, 1), (64, 8, 2), (2, 0, 2)],
)
def test_a_worker_copies_on_two_threads_only_where_every_worker_can(
    monkeypatch: pytest.MonkeyPatch, cores: int, world_size: int, threads: int
) -> None:
    """Two workers with two threads each on two cores were slower than with one each."""
    import os

    from wtcore_ipc.worker import copy_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert copy_threads(world_size) == threads


@contextmanager
def _reader() -> Iterator[tuple[SegmentReader, int]]:
    """A worker's reader of a fresh 1 MiB segment, and the offset of its first slot's data."""
    seg = StagingSegment(1 << 20, 1)
    try:
        assert seg.fd is not None
        reader = SegmentReader(seg.name, seg.fd)
        try:
            yield reader, seg.data_offset(0)
        finally:
            reader.close()
    finally:
        seg.close()


def test_an_error_on_a_helper_thread_fails_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails on the second thread must not leave the round looking complete."""
    real = shm._copy_out

    def fails_on_a_helper(buf: torch.Tensor, reads: Any) -> None:
        if threading.current_thread().name == "wtcore-ipc-copy":
            raise RuntimeError("the helper's copy failed")
        real(buf, reads)

    monkeypatch.setattr(shm, "_copy_out", fails_on_a_helper)
    with _reader() as (reader, at), pytest.raises(RuntimeError, match="helper's copy failed"):
        reader.read_many([(at, _flat(100)), (at + 100, _flat(100))], threads=2)


@pytest.mark.parametrize(
    "out",
    [
        torch.zeros(25),  # not bytes
        torch.zeros(20, 10, dtype=torch.uint8).t(),  # not contiguous
        torch.zeros(100, dtype=torch.uint8, device="meta"),  # not in this process's memory
    ],
    ids=["float32", "transposed", "meta"],
)
def test_a_read_into_anything_but_flat_cpu_bytes_is_refused_before_any_copy(
    out: torch.Tensor,
) -> None:
    """The copy writes through raw addresses (memcpy), so what it writes into is checked
    first: a wrong destination is an error, and the good destination listed before it stays
    untouched."""
    with _reader() as (reader, at):
        reader.view(at, 100).fill_(7)
        first = _flat(100).fill_(1)
        with pytest.raises(PayloadError, match="contiguous uint8 CPU tensor"):
            reader.read_many([(at, first), (at, out)], threads=2)
        assert torch.equal(first, torch.ones(100, dtype=torch.uint8))


@pytest.mark.parametrize("memcpy", [True, False], ids=["memcpy", "torch-copy"])
def test_both_copies_land_every_byte(monkeypatch: pytest.MonkeyPatch, memcpy: bool) -> None:
    """glibc's memcpy where ctypes finds it, torch's copy where it does not: the same bytes."""
    if not memcpy:
        monkeypatch.setattr(shm, "_memcpy", lambda: None)
    else:
        assert shm._memcpy() is not None, "this host's C library has memcpy"
    with _reader() as (reader, at):
        src = torch.randint(0, 256, (5000,), dtype=torch.uint8)
        reader.view(at, 5000).copy_(src)
        outs = [_flat(n) for n in (1, 999, 0, 4000)]
        reads, pos = [], at
        for o in outs:
            reads.append((pos, o))
            pos += o.numel()
        reader.read_many(reads, threads=2)
        assert torch.equal(torch.cat(outs), src)
