"""The sharded plan: every receiver element exactly once, bit-exact, and the same on both ends.

A reference executor cuts each sending rank's part out of a full tensor, runs the plan chunk
by chunk (each chunk copies a region of the sender's local part into a region of the
receiver's) and checks every receiver's part against the full tensor (``torch.equal``). The
bytes a receiver gets are counted against the plan.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout, Replicate, Shard, tp_layout
from wtcore.sharded.plan import (
    Chunk,
    Plan,
    check_coverage,
    check_digest,
    plan_tensor,
    plan_transfer,
)
from wtcore.testing.sharded import execute_plan, part


def _check(full: dict[str, torch.Tensor], src: dict[str, Layout], dst: dict[str, Layout]) -> Plan:
    plan = plan_transfer([(ParamMeta.of(n, t), src[n], dst[n]) for n, t in full.items()])
    out, got = execute_plan(full, plan, src, dst)
    for r, n in got.items():
        assert n == plan.nbytes(dst=r)  # what moved is what was planned
    for (n, r), got_part in out.items():
        assert torch.equal(got_part, part(full[n], dst[n].boxes[r])), (n, r)
        # each receiver gets exactly its part's bytes, never another receiver's slice
    for r in range(max(lay.world_size for lay in dst.values())):
        want = sum(
            part(t, dst[n].boxes[r]).nbytes  # type: ignore[union-attr]
            for n, t in full.items()
            if r < dst[n].world_size and dst[n].boxes[r] is not None
        )
        assert plan.nbytes(dst=r) == want
    return plan


def _full(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod())).reshape(shape).to(dtype)


@pytest.mark.parametrize(("m", "n"), [(1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (3, 3), (1, 1)])
@pytest.mark.parametrize(
    ("send", "recv"),
    [
        (Shard(0), Shard(0)),
        (Shard(0), Shard(1)),
        (Shard(1), Shard(0)),
        (Shard(1), Shard(1)),
        (Shard(0), Replicate()),
        (Replicate(), Shard(1)),
        (Replicate(), Replicate()),
    ],
)
def test_m_to_n_is_bit_exact_with_uneven_splits(
    m: int, n: int, send: Shard | Replicate, recv: Shard | Replicate
) -> None:
    full = {"w": _full(7, 5), "b": _full(5, dtype=torch.bfloat16)}
    src = {
        k: Layout.placed(t.shape, (m,), (send if t.dim() == 2 else Shard(0),))
        for k, t in full.items()
    }
    dst = {
        k: Layout.placed(t.shape, (n,), (recv if t.dim() == 2 else Replicate(),))
        for k, t in full.items()
    }
    plan = _check(full, src, dst)
    # a sender sends only what it holds: never more bytes than its parts, times the receivers
    for s in range(m):
        held = sum(part(t, src[k].boxes[s]).nbytes for k, t in full.items())  # type: ignore[union-attr]
        assert plan.nbytes(src=s) <= held * n


def test_replicated_senders_spread_the_load_over_receivers() -> None:
    full = {"w": _full(8, 4)}
    plan = _check(
        full,
        {"w": Layout.placed((8, 4), (2,), (Replicate(),))},
        {"w": Layout.placed((8, 4), (2,), (Shard(0),))},
    )
    assert plan.pairs() == [(0, 0), (1, 1)]  # each receiver from its own sender


def test_two_dimensional_meshes_and_one_owner_tensors() -> None:
    full = {"grid": _full(6, 6), "stage": _full(4, 3), "scalar": torch.tensor(3.5)}
    src = {
        "grid": Layout.placed((6, 6), (2, 2), (Shard(0), Shard(1))),
        "stage": Layout.whole((4, 3), owner=3, world_size=4),  # a pipeline rank's tensor
        "scalar": Layout.whole((), owner=1, world_size=4),
    }
    dst = {
        "grid": tp_layout((6, 6), "row", 3),
        "stage": tp_layout((4, 3), "column", 3),
        "scalar": tp_layout((), "replicated", 3),
    }
    plan = _check(full, src, dst)
    assert {c.src for c in plan.chunks if c.name == "stage"} == {3}
    assert plan.pairs() == sorted(plan.pairs())  # grouped per (sender, receiver) pair


def test_whole_tensors_are_the_one_rank_case() -> None:
    full = {"a": _full(3, 4), "b": _full(2)}
    one = {k: Layout.whole(t.shape) for k, t in full.items()}
    plan = _check(full, one, one)
    assert [(c.name, c.src, c.dst, c.src_box, c.dst_box) for c in plan.chunks] == [
        ("a", 0, 0, ((0, 3), (0, 4)), ((0, 3), (0, 4))),
        ("b", 0, 0, ((0, 2),), ((0, 2),)),
    ]


def test_a_gap_is_refused_naming_the_tensor_and_region() -> None:
    # rank 1 of the senders holds nothing: rows 3-6 of "w" are nobody's
    src = Layout(shape=(6, 2), boxes=(((0, 3), (0, 2)), None))
    with pytest.raises(
        PayloadError,
        match=r"'w': region \[3:6, 0:2\] of receiving rank 0 is held by no sending rank",
    ):
        plan_tensor("w", 4, src, Layout.whole((6, 2)))
    with pytest.raises(
        PayloadError,
        match=r"'w': the senders' layout is of shape \[6, 2\], the receivers' of \[2, 6\]",
    ):
        plan_tensor("w", 4, Layout.whole((6, 2)), Layout.whole((2, 6)))
    meta = ParamMeta("w", torch.float32, (6, 3))
    with pytest.raises(
        PayloadError, match=r"'w': metadata of shape \[6, 3\], layout of shape \[6, 2\]"
    ):
        plan_transfer([(meta, Layout.whole((6, 2)), Layout.whole((6, 2)))])


def test_coverage_is_proved_independently_of_the_planner() -> None:
    dst = Layout.placed((4, 4), (2,), (Shard(0),))
    good = plan_tensor("w", 4, Layout.whole((4, 4)), dst)
    check_coverage("w", good, dst, 4)
    twice = [*good, dataclasses.replace(good[0], dst_box=((1, 2), (0, 4)), nbytes=16)]
    with pytest.raises(
        PayloadError, match=r"'w': region \[1:2, 0:4\] of receiving rank 0 is covered twice"
    ):
        check_coverage("w", twice, dst, 4)
    short = [dataclasses.replace(good[0], dst_box=((0, 1), (0, 4)), nbytes=16), *good[1:]]
    with pytest.raises(
        PayloadError,
        match=r"4 of the 8 elements of receiving rank 0's part \[0:2, 0:4\] are covered by no chunk",
    ):
        check_coverage("w", short, dst, 4)
    outside = [dataclasses.replace(good[0], dst_box=((0, 3), (0, 4)), nbytes=48), *good[1:]]
    with pytest.raises(
        PayloadError, match=r"region \[0:3, 0:4\] lies outside receiving rank 0's part"
    ):
        check_coverage("w", outside, dst, 4)
    stray = [*good, Chunk("w", 0, 5, ((0, 1), (0, 1)), ((0, 1), (0, 1)), 4)]
    with pytest.raises(PayloadError, match="a chunk for receiving rank 5, which needs none"):
        check_coverage("w", stray, dst, 4)


def test_both_ends_agree_on_the_digest_and_a_mismatch_names_both() -> None:
    metas = [ParamMeta("w", torch.float32, (8, 4))]
    src = Layout.placed((8, 4), (2,), (Shard(0),))
    sender = plan_transfer([(metas[0], src, tp_layout((8, 4), "row", 2))])
    receiver = plan_transfer(
        [(metas[0], Layout.from_wire(src.to_wire()), tp_layout((8, 4), "row", 2))]
    )
    assert sender.digest() == receiver.digest() and sender.digest().startswith("sha256:")
    check_digest(sender.digest(), receiver.digest(), peer="receiver 1")
    other = plan_transfer([(metas[0], src, tp_layout((8, 4), "column", 2))])
    assert other.digest() != sender.digest()
    with pytest.raises(
        PayloadError,
        match=rf"plan digest: receiver 1 planned '{other.digest()}', this side planned '{sender.digest()}'",
    ):
        check_digest(sender.digest(), other.digest(), peer="receiver 1")


def _round() -> tuple[list[ParamMeta], dict[str, Layout], dict[str, Layout]]:
    full = {"a": _full(7, 5), "b": _full(4, 3, dtype=torch.bfloat16), "c": _full(6)}
    metas = [ParamMeta.of(n, t) for n, t in full.items()]
    src = {n: Layout.placed(t.shape, (2,), (Shard(0),)) for n, t in full.items()}
    dst = {n: tp_layout(t.shape, "row", 3) for n, t in full.items()}
    return metas, src, dst


def test_a_planned_round_travels_and_the_receiver_plans_the_same() -> None:
    import json

    from wtcore.sharded.plan import PlannedRound

    metas, src, dst = _round()
    sent = PlannedRound.make(metas, src, dst)
    got = PlannedRound.from_wire(json.loads(json.dumps(sent.to_wire())))
    assert got == sent
    assert got.plan.digest() == sent.plan.digest()


def _forged(key: str, value: object) -> dict[str, object]:
    from wtcore.sharded.plan import PlannedRound

    wire = PlannedRound.make(*_round()).to_wire()
    if value is _DROP:
        del wire[key]
    else:
        wire[key] = value
    return wire


_DROP = object()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("digest", "sha256:" + "0" * 64, r"plan digest: the trainer planned 'sha256:0+'"),
        ("digest", _DROP, r"plan: missing or unknown field 'digest'"),
        ("extra", 1, r"plan: missing or unknown field 'extra'"),
        ("names", ["a", "b"], r"plan\.names, dtype_names and shapes must have the same length"),
        ("senders", [], r"plan\.senders: expected one layout per tensor"),
        ("receivers", "x", r"plan\.receivers: expected one layout per tensor"),
        ("senders", [{"shape": [7, 5], "boxes": []}] * 3, r"plan\.senders\[0\]\.boxes"),
        (
            "senders",
            [{"shape": [7, 6], "boxes": [[[0, 7], [0, 6]]]}] * 3,
            r"plan: the layouts of 'a' \(tensor 0\) are not of its shape",
        ),
        (
            "receivers",
            [{"shape": [7, 5], "boxes": [[[0, 9], [0, 5]]]}] * 3,
            r"plan\.receivers\[0\]\.boxes\[0\]\[0\]",
        ),
    ],
)
def test_a_forged_planned_round_is_refused_naming_the_field(
    key: str, value: object, match: str
) -> None:
    from wtcore.sharded.plan import PlannedRound

    with pytest.raises(PayloadError, match=match):
        PlannedRound.from_wire(_forged(key, value))


def test_layouts_that_cut_a_tensor_into_too_many_chunks_are_refused() -> None:
    # 2000 senders of one row each into 2000 receivers of one column each: 4 million cells
    n = 2000
    src = Layout((n, n), tuple(((i, i + 1), (0, n)) for i in range(n)))
    dst = Layout((n, n), tuple(((0, n), (i, i + 1)) for i in range(n)))
    with pytest.raises(PayloadError, match="'w': the layouts cut this tensor into more than"):
        plan_tensor("w", 4, src, dst)
    with pytest.raises(PayloadError, match="more than 10 chunks"):
        plan_tensor("w", 4, *(Layout.placed((8, 8), (4, 4), (Shard(0), Shard(1))),) * 2, limit=10)
