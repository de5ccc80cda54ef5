"""The shared bucket rule and packing."""

from __future__ import annotations

import pytest
import torch

from wtcore import ParamMeta, PayloadError, TensorSource
from wtcore.buckets import (
    ALIGNMENT,
    pack_bucket,
    pack_source,
    per_tensor_buckets,
    plan_buckets,
    plan_round,
    unpack_bucket,
)
from wtcore.testing import MismatchedSource, mixed_dtype_state


def _m(name: str, nbytes: int) -> ParamMeta:
    return ParamMeta(name, torch.uint8, (nbytes,))


def test_bucket_closes_before_exceeding_buffer() -> None:
    buckets = plan_buckets([_m("a", 64), _m("b", 64), _m("c", 1)], 128)
    assert [[m.name for m in b.metas] for b in buckets] == [["a", "b"], ["c"]]
    assert buckets[0].offsets == (0, 64) and buckets[0].nbytes == 128


def test_offsets_are_aligned() -> None:
    [b] = plan_buckets([_m("a", 3), _m("b", 5), _m("c", 0)], 1 << 20)
    assert all(off % ALIGNMENT == 0 for off in b.offsets)
    assert b.offsets == (0, ALIGNMENT, 2 * ALIGNMENT)
    assert b.payload_nbytes == 8


def test_tensor_larger_than_buffer_travels_alone() -> None:
    buckets = plan_buckets([_m("a", 10), _m("big", 1000), _m("c", 10)], 100)
    assert [[m.name for m in b.metas] for b in buckets] == [["a"], ["big"], ["c"]]
    assert buckets[1].nbytes == 1000


def test_direct_min_bytes_sends_large_tensors_alone_and_packs_the_runs_between() -> None:
    metas = [_m("a", 10), _m("b", 10), _m("big", 64), _m("c", 10), _m("d", 0), _m("huge", 90)]
    buckets = plan_round(metas, packed=True, buffer_size_bytes=100, direct_min_bytes=64)
    assert [[m.name for m in b.metas] for b in buckets] == [
        ["a", "b"],
        ["big"],
        ["c", "d"],
        ["huge"],
    ]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    # Each run between large tensors is planned as the plain rule plans it on its own.
    assert buckets[2].offsets == plan_buckets(metas[3:5], 100)[0].offsets
    # 0 (the default) is the plain rule; unpacked ignores it.
    assert plan_round(metas, packed=True, buffer_size_bytes=100) == plan_buckets(metas, 100)
    unpacked = plan_round(metas, packed=False, buffer_size_bytes=100, direct_min_bytes=64)
    assert unpacked == per_tensor_buckets(metas)


def test_empty_and_invalid() -> None:
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([_m("a", 1)], 0)


def test_pack_unpack_round_trip_is_bit_exact() -> None:
    state = mixed_dtype_state()
    metas = TensorSource(state).metadata()
    for b in plan_buckets(metas, 256):
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        pack_bucket(b, [state[m.name] for m in b.metas], buf)
        for name, view in unpack_bucket(b, buf):
            assert torch.equal(view, state[name]), name


def test_pack_source_reuses_one_buffer() -> None:
    state = mixed_dtype_state()
    src = TensorSource(state)
    metas = src.metadata()
    buckets = plan_buckets(metas, 512)
    staging = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
    seen = []
    for bucket, filled in pack_source(src, metas, buckets, lambda _b: staging):
        assert filled.data_ptr() == staging.data_ptr()
        seen += [(n, v.clone()) for n, v in unpack_bucket(bucket, filled)]
    assert [n for n, _ in seen] == list(state)
    assert all(torch.equal(v, state[n]) for n, v in seen)


@pytest.mark.parametrize("kind", ["extra", "missing", "redtyped"])
def test_pack_source_raises_before_yielding_the_bad_bucket(kind: str) -> None:
    state = mixed_dtype_state()
    src = MismatchedSource(TensorSource(state), kind)
    metas = src.metadata()
    buckets = plan_buckets(metas, 1 << 20)  # everything in one bucket
    assert len(buckets) == 1
    yielded = []
    with pytest.raises(PayloadError, match="metadata"):
        for bucket, _ in pack_source(
            src, metas, buckets, lambda b: torch.empty(b.nbytes, dtype=torch.uint8)
        ):
            yielded.append(bucket)
    assert yielded == []
