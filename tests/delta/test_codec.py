"""The patch codec: round trips under Hypothesis, and hostile blobs refused before any write."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wtcore.errors import (
    ErrorRecord,
    PayloadError,
    ProtocolStateError,
    ReceiverError,
    http_status,
)
from wtcore_delta.codec import (
    HEADER_BYTES,
    MASK,
    RUNS,
    apply_patch,
    bits,
    decode,
    encode,
    plan,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool]


@st.composite
def pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A base and a new tensor of any supported dtype: scattered, clustered or dense changes."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    base = raw.view(torch.uint8 if dtype == torch.bool else dtype).clone()
    if dtype == torch.bool:
        base = (base & 1).bool()
    new = base.clone()
    nb = bits(new)
    shape = draw(st.sampled_from(["scattered", "runs", "dense", "none", "nan"]))
    if shape == "scattered":
        k = draw(st.integers(1, n))
        idx = torch.randperm(n, generator=g)[:k]
        nb[idx] ^= 1
    elif shape == "runs":
        for _ in range(draw(st.integers(1, 5))):
            a = draw(st.integers(0, n - 1))
            nb[a : a + draw(st.integers(1, 64))] ^= 1
    elif shape == "dense":
        nb ^= 1
    elif shape == "nan" and dtype.is_floating_point:
        new[: max(1, n // 3)] = float("nan")
        new[n // 2 :] = -0.0
    return base, new


@settings(max_examples=200, deadline=None)
@given(pairs())
def test_round_trip_is_bit_exact(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    base, new = pair
    enc, idx = encode(new, base)
    target = base.clone()
    if enc.kind == "patch":
        assert enc.blob is not None and idx is not None
        assert enc.blob.numel() < new.numel() * new.element_size()  # only when smaller
        apply_patch(target, decode(enc.blob, target, name="t"))
        assert torch.equal(bits(target), bits(new))
    elif enc.kind == "same":
        assert torch.equal(bits(base), bits(new))
    else:
        assert enc.kind == "full" and enc.count > 0


@settings(max_examples=200, deadline=None)
@given(pairs(), st.data())
def test_corrupted_blobs_are_refused_or_stay_in_bounds(
    pair: tuple[torch.Tensor, torch.Tensor], data: st.DataObject
) -> None:
    # Any byte of a patch may be changed by a hostile peer: decode either refuses it with a
    # PayloadError naming the tensor, or returns positions inside the tensor (never a crash,
    # never a write outside it).
    base, new = pair
    enc, _ = encode(new, base)
    if enc.kind != "patch":
        return
    assert enc.blob is not None
    blob = enc.blob.clone()
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, blob.numel() - 1))
        blob[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, blob.numel()))]
    target = base.clone()
    try:
        patch = decode(blob, target, name="layer.w")
    except PayloadError as e:
        assert "'layer.w'" in str(e)
        assert torch.equal(bits(target), bits(base))
        return
    pos = patch.positions
    assert pos.numel() == patch.values.numel()
    if pos.numel():
        assert int(pos.min()) >= 0 and int(pos.max()) < base.numel()
        assert bool((pos[1:] > pos[:-1]).all())
    apply_patch(target, patch)


def _blob(encoding: int, numel: int, count: int, runs: int, body: bytes) -> torch.Tensor:
    head = struct.pack("<4sBBBBQQQ", b"WTDP", 1, encoding, 2, 0, numel, count, runs)
    return torch.frombuffer(bytearray(head + body), dtype=torch.uint8)


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (_blob(1, 8, 1, 0, struct.pack("<i", 8) + b"\0\0"), "outside"),
        (_blob(1, 8, 1, 0, struct.pack("<i", -1) + b"\0\0"), "outside"),
        (_blob(1, 8, 2, 0, struct.pack("<ii", 3, 3) + b"\0" * 4), "strictly increasing"),
        (_blob(MASK, 8, 2, 0, b"\x01" + b"\0" * 4), "mask marks 1"),
        (_blob(MASK, 4, 1, 0, b"\x10" + b"\0\0"), "padding"),
        (_blob(RUNS, 8, 3, 1, struct.pack("<ii", 6, 3) + b"\0" * 6), "past the tensor"),
        (_blob(RUNS, 8, 4, 2, struct.pack("<iiii", 0, 2, 1, 2) + b"\0" * 8), "overlap"),
        (_blob(9, 8, 1, 0, b"\0" * 6), "unknown encoding"),
        (_blob(1, 9, 1, 0, struct.pack("<i", 0) + b"\0\0"), "numel 9"),
        (_blob(1, 8, 1, 0, struct.pack("<i", 0)), "bytes, expected"),
        (torch.zeros(10, dtype=torch.uint8), "shorter"),
        (torch.zeros(40, dtype=torch.int8), "flat uint8"),
    ],
)
def test_hostile_blobs_name_the_tensor(blob: torch.Tensor, why: str) -> None:
    numel = 4 if why == "padding" else 8
    target = torch.zeros(numel, dtype=torch.bfloat16)
    with pytest.raises(PayloadError, match=why) as err:
        decode(blob, target, name="layer0.w")
    assert "'layer0.w'" in str(err.value)
    assert torch.equal(target, torch.zeros(numel, dtype=torch.bfloat16))
    assert HEADER_BYTES == 32


def test_stale_base_is_a_409_and_a_receivers_one_makes_the_trainer_resend_in_full() -> None:
    from wtcore_delta.receiver import StaleBaseError
    from wtcore_delta.trainer import _refused
    from wtcore_kit.fanout import failure_of

    error = StaleBaseError("x")
    assert isinstance(error, ProtocolStateError) and http_status(error) == 409
    # from a receiver in another process: a RemoteError keeping the name and the status
    again = ErrorRecord.from_exception(error).to_exception("w0.update_weights")
    assert http_status(again) == 409 and again.record.type == "StaleBaseError"
    assert _refused(ReceiverError.of("update_weights", [failure_of("w0", again)], 2))


def test_a_patch_for_another_dtype_or_shape_is_refused() -> None:
    # Same element width, other dtype (bf16 patch, fp16 tensor): the header's spec says so.
    from wtcore_delta.header import HEADER_NAME, DeltaHeader, new_lineage
    from wtcore_delta.receiver import DeltaSink

    held = torch.zeros(64, dtype=torch.float16)
    new = torch.zeros(64, dtype=torch.bfloat16)
    new[3] = 1.0
    enc, _ = encode(new, torch.zeros(64, dtype=torch.bfloat16))
    assert enc.blob is not None
    sink = DeltaSink(ModuleSinkStub(), readable=None, in_place={"w": held}, accepts=True)
    lineage = new_lineage()
    sink.begin(None, False)  # a full round of this lineage (its header only: nothing changed)
    sink.load_weights([(HEADER_NAME, DeltaHeader(None, {}, lineage=lineage).to_tensor())])
    sink.finish()
    for spec in (("bfloat16", [64]), ("float16", [8, 8])):
        sink.begin("v1", True)
        header = DeltaHeader("v1", {"w": "patch"}, {"w": spec}, lineage).to_tensor()
        with pytest.raises(PayloadError, match="'w': computed for") as err:
            sink.load_weights([(HEADER_NAME, header), ("w", enc.blob)])
        assert "float16 [64]" in str(err.value)
        assert not bool(held.any())


class ModuleSinkStub:
    def load_weights(self, weights: object) -> None:
        raise AssertionError("nothing whole in this test")


@pytest.mark.parametrize(
    "items",
    [
        [["w", "patch"]],
        [["w", "patch", "complex32", [4]]],
        [["w", "patch", "bfloat16", [-1]]],
        [["w", "patch", "bfloat16", [True]]],
        [["w", "full"], ["w", "full"]],
        [["__wtcore_delta__", "full"]],
        [["w", "same"]],
        [[1, "full"]],
        "w",
        {"format": 1, "base": "v1", "items": []},  # no lineage: whose base is it?
        {"lineage": "a" * 31},
        {"lineage": "A" * 32},
        {"lineage": "a" * 32 + "\n"},
        {"lineage": None},
        {"base": None},  # a full round's header lists nothing
        {"base": ""},
    ],
)
def test_malformed_headers_are_refused(items: object) -> None:
    import json

    from wtcore_delta.header import DeltaHeader

    data: dict[str, object] = {"format": 2, "lineage": "0" * 32, "base": "v1", "items": items}
    if isinstance(items, dict):  # the items are fine, another field is not
        data = items if "format" in items else {**data, "items": [["w", "full"]], **items}
    raw = json.dumps(data).encode()
    with pytest.raises(PayloadError, match="delta header"):
        DeltaHeader.from_tensor(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def test_a_planned_mask_patch_is_completed_later_and_bit_exact() -> None:
    # plan() sizes a bitmask patch before its values are gathered (the gather runs while the
    # engine sends earlier buckets); the comparison buffer is reused by other tensors between.
    import numpy as np

    g = torch.Generator().manual_seed(3)
    base = torch.randn(50_000, generator=g).to(torch.bfloat16)
    new = base.clone()
    bits(new)[torch.rand(50_000, generator=g) < 0.2] += 1
    scratch = np.empty(60_000, dtype=np.bool_)
    enc, finish = plan(new, base, scratch=scratch)
    assert enc.kind == "patch" and enc.encoding == MASK and finish is not None
    assert enc.blob is not None
    size = enc.blob.numel()
    other = torch.zeros(60_000, dtype=torch.int16)
    plan(other + 1, other, scratch=scratch)  # another tensor overwrites the scratch
    idx = finish()
    assert enc.blob.numel() == size and idx.numel() == enc.count
    target = base.clone()
    apply_patch(target, decode(enc.blob, target, name="w"))
    assert torch.equal(bits(target), bits(new))


def test_a_tensor_changed_between_plan_and_finish_is_refused() -> None:
    base = torch.zeros(10_000, dtype=torch.bfloat16)
    new = base.clone()
    bits(new)[::4] = 1
    enc, finish = plan(new, base)
    assert enc.encoding == MASK and finish is not None
    bits(new)[1] = 1  # the weights moved under the trainer: the sized blob would lie
    with pytest.raises(PayloadError, match="changed while encoding"):
        finish()
