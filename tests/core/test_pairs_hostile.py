"""A receiver of a sharded round trusts nothing in an update: forged buckets are refused by
field before a byte is applied, and a round is never published short.

Real ``WeightSyncWorker`` s with the inline engine, driven call by call as a hostile or buggy
trainer would, with a genuine plan for two receivers holding TP slices.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout
from wtcore.sharded.plan import PlannedRound
from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
from wtcore_kit.sharded.pairs import PairAssembler, pack_pair, pair_buckets
from wtcore_kit.synthetic import build_module

RULES = (("w", "column"),)
BUFFER = 64


def whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.randn(5, generator=g)}


def planned(m: int = 2) -> PlannedRound:
    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    src = {k: _rows(t, m) for k, t in full.items()}
    dst = receiver_layouts([TPLayout(r, 2, RULES) for r in range(2)], metas)
    return PlannedRound.make(metas, src, dst)


def _rows(t: torch.Tensor, m: int) -> Layout:
    from wtcore.sharded.layout import Shard

    return Layout.placed(t.shape, (m,), (Shard(0),))


def worker(rank: int, *, transactional: bool = False) -> WeightSyncWorker:
    lay = TPLayout(rank, 2, RULES)
    held = {k: torch.zeros_like(lay.local(k, t)) for k, t in whole().items()}
    w = WeightSyncWorker(
        "inline",
        ModuleSink(build_module(held), layout=lay),
        rank=rank,
        world_size=2,
        transactional=transactional,
    )
    w.init_weight_transfer_engine({"packed_buffer_size_bytes": BUFFER})
    return w


def entries(p: PlannedRound, dst: int) -> list[dict[str, Any]]:
    """Every bucket receiver ``dst`` is owed, packed from the senders' real parts."""
    full = whole()
    out = []
    for s, d in p.plan.pairs():
        if d != dst:
            continue
        local = {
            k: t[tuple(slice(a, b) for a, b in lay.boxes[s])]  # type: ignore[union-attr]
            for (k, t), lay in zip(full.items(), p.senders, strict=True)
            if lay.boxes[s] is not None
        }
        for k, (bucket, chunks) in enumerate(pair_buckets(p, s, d, BUFFER)):
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            data = base64.b64encode(pack_pair(bucket, chunks, local, buf).numpy().tobytes())
            out.append({"src": s, "bucket": k, "data": data.decode()})
    return out


def held(w: WeightSyncWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in w.sink.module.named_parameters()}  # type: ignore[attr-defined]


def test_an_honest_round_call_by_call_is_exact() -> None:
    p = planned()
    w = worker(1)
    w.start_weight_update()
    w.update_weights({"plan": p.to_wire()})
    items = entries(p, 1)
    assert len(items) > 2  # several buckets from both senders
    for item in items:
        w.update_weights({"buckets": [item]})
    w.finish_weight_update("v1")
    lay = TPLayout(1, 2, RULES)
    for k, t in whole().items():
        assert torch.equal(held(w)[k], lay.local(k, t)), k
    info = w.weight_info()
    assert info["consistent"] and info["round_bytes"]["planned"] == info["round_bytes"]["landed"]


def _forge(items: list[dict[str, Any]], how: str) -> list[Any]:
    first = dict(items[0])
    if how == "unknown sender":
        return [{**first, "src": 7}]
    if how == "skips a bucket":
        return [next(i for i in items if i["bucket"] == 1)]
    if how == "long data":
        raw = base64.b64decode(first["data"]) + b"\0"
        return [{**first, "data": base64.b64encode(raw).decode()}]
    if how == "short data":
        raw = base64.b64decode(first["data"])[:-1]
        return [{**first, "data": base64.b64encode(raw).decode()}]
    if how == "not base64":
        return [{**first, "data": "@@@"}]
    if how == "bool index":
        return [{**first, "bucket": False}]
    if how == "extra field":
        return [{**first, "offset": 0}]
    if how == "not an object":
        return ["x"]
    if how == "good then bad":  # the good one must not be applied either
        return [first, {**items[1], "src": 9}]
    raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("unknown sender", r"src: sending rank 7 has nothing for receiver 1"),
        ("skips a bucket", r"bucket: expected bucket 0 of sending rank"),
        ("long data", r"data: bucket 0 of sending rank \d holds \d+ bytes, got \d+"),
        ("short data", r"data: bucket 0 of sending rank \d holds \d+ bytes, got \d+"),
        ("not base64", r"update_info\.buckets\[0\]\.data: not valid base64"),
        ("bool index", r"update_info\.buckets\[0\]: src and bucket must be integers"),
        ("extra field", r"update_info\.buckets\[0\]: expected an object of src, bucket and data"),
        ("not an object", r"update_info\.buckets\[0\]: expected an object"),
        ("good then bad", r"src: sending rank 9 has nothing"),
    ],
)
def test_a_forged_bucket_is_refused_by_field_and_nothing_is_applied(how: str, match: str) -> None:
    p = planned()
    w = worker(1)
    before = held(w)
    w.start_weight_update()
    w.update_weights({"plan": p.to_wire()})
    with pytest.raises(PayloadError, match=match):
        w.update_weights({"buckets": _forge(entries(p, 1), how)})
    assert all(torch.equal(before[k], v) for k, v in held(w).items())
    assert w.weight_info()["state"] == "idle"  # the round is over, nothing published
    assert w.weight_info()["weight_version"] is None


def test_a_round_missing_a_bucket_or_a_sender_is_never_published() -> None:
    p = planned()
    w = worker(0)
    w.start_weight_update()
    w.update_weights({"plan": p.to_wire()})
    items = entries(p, 0)
    w.update_weights({"buckets": [i for i in items if i["src"] == 0]})  # sender 1 never sends
    with pytest.raises(PayloadError, match=r"round incomplete on receiver 0: sending rank 1: "):
        w.finish_weight_update("v1")
    info = w.weight_info()
    assert info["weight_version"] is None and not info["consistent"]


@pytest.mark.parametrize(
    ("updates", "match"),
    [
        ([{"buckets": []}], r"update_info\.buckets: no plan was sent in this round"),
        ([{"plan": "PLAN"}, {"plan": "PLAN"}], r"update_info\.plan: this round already has"),
        (
            [
                {"plan": "PLAN"},
                {"names": ["b"], "dtype_names": ["float32"], "shapes": [[5]], "data": ""},
            ],
            r"this round is sharded",
        ),
    ],
)
def test_updates_out_of_place_in_a_sharded_round_are_refused(
    updates: list[dict[str, Any]], match: str
) -> None:
    wire = planned().to_wire()
    w = worker(0)
    w.start_weight_update()
    with pytest.raises(PayloadError, match=match):
        for u in updates:
            w.update_weights({"plan": wire} if u.get("plan") == "PLAN" else u)


def test_a_plan_for_another_receiver_count_is_refused() -> None:
    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    three = receiver_layouts([TPLayout(r, 3, RULES) for r in range(3)], metas)
    p = PlannedRound.make(metas, {k: _rows(t, 2) for k, t in full.items()}, three)
    w = worker(1)
    w.start_weight_update()
    with pytest.raises(PayloadError, match=r"planned for 3 receivers, this one is rank 1 of 2"):
        w.update_weights({"plan": p.to_wire()})


def test_a_transactional_receiver_assembles_in_staging_and_commits_at_finish() -> None:
    p = planned()
    w = worker(1, transactional=True)
    w.start_weight_update()
    w.update_weights({"plan": p.to_wire()})
    w.update_weights({"buckets": entries(p, 1)})
    assert all(not v.any() for v in held(w).values())  # nothing reaches the model before finish
    w.finish_weight_update("v1")
    lay = TPLayout(1, 2, RULES)
    assert all(torch.equal(held(w)[k], lay.local(k, t)) for k, t in whole().items())


def test_the_assembler_writes_in_place_where_the_sink_offers_the_tensor() -> None:
    p = planned()
    lay = TPLayout(0, 2, RULES)
    module = build_module({k: torch.zeros_like(lay.local(k, t)) for k, t in whole().items()})
    sink = ModuleSink(module, layout=lay)
    ptrs = {k: v.data_ptr() for k, v in module.named_parameters()}
    a = PairAssembler(p, 0, BUFFER, sink)
    items = entries(p, 0)
    a.take(
        [
            (
                i["src"],
                i["bucket"],
                torch.frombuffer(bytearray(base64.b64decode(i["data"])), dtype=torch.uint8),
            )
            for i in items
        ]
    )
    a.check_complete()
    for k, v in module.named_parameters():
        assert v.data_ptr() == ptrs[k] and torch.equal(v, lay.local(k, whole()[k])), k
