"""The sharded plan: every receiver element exactly once, bit-exact, and the same on both ends.

A reference executor cuts each sending rank's part out of a full tensor, runs the plan chunk
by chunk (each chunk copies a region of the sender's local part into a region of the
receiver's) and checks every receiver's part against the full tensor (``torch.equal``). The
bytes a receiver gets are counted against the plan.
"""

from __future__ import annotations

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout, Replicate, Shard, tp_layout, volume
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
    assert {c.src for c in plan.select() if c.name == "stage"} == {3}
    assert plan.pairs() == sorted(plan.pairs())  # grouped per (sender, receiver) pair


def test_whole_tensors_are_the_one_rank_case() -> None:
    full = {"a": _full(3, 4), "b": _full(2)}
    one = {k: Layout.whole(t.shape) for k, t in full.items()}
    plan = _check(full, one, one)
    assert [(c.name, c.src, c.dst, c.src_box, c.dst_box) for c in plan.select()] == [
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
    twice = [*good, good[0]._replace(dst_box=((1, 2), (0, 4)), nbytes=16)]
    with pytest.raises(
        PayloadError, match=r"'w': region \[1:2, 0:4\] of receiving rank 0 is covered twice"
    ):
        check_coverage("w", twice, dst, 4)
    short = [good[0]._replace(dst_box=((0, 1), (0, 4)), nbytes=16), *good[1:]]
    with pytest.raises(
        PayloadError,
        match=r"4 of the 8 elements of receiving rank 0's part \[0:2, 0:4\] are covered by no chunk",
    ):
        check_coverage("w", short, dst, 4)
    outside = [good[0]._replace(dst_box=((0, 3), (0, 4)), nbytes=48), *good[1:]]
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
    assert got == sent  # the same inputs, so the same plan
    assert got.plan.digest() == sent.plan.digest()
    assert got.plan.select() == sent.plan.select()


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
        ("senders", [], r"plan\.senders: expected one layout index per tensor"),
        ("receivers", "x", r"plan\.receivers: expected one layout index per tensor"),
        ("senders", [0, 1, 99], r"plan\.senders\[2\]: expected a layout index, got 99"),
        ("senders", [0, 1, True], r"plan\.senders\[2\]: expected a layout index, got True"),
        ("senders", [1, 1, 2], r"plan\.senders\[0\]: the layout of 'a' is not of its shape"),
        ("layouts", [{"shape": [7, 5], "boxes": []}] * 6, r"plan\.layouts\[0\]\.boxes"),
        ("layouts", [{"shape": [], "boxes": [[]]}] * 7, r"plan\.layouts: .* at most two per"),
        (
            "layouts",
            [{"shape": [7, 5], "boxes": [[[0, 9], [0, 5]]]}] * 6,
            r"plan\.layouts\[0\]\.boxes\[0\]\[0\]",
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


def test_each_rank_plans_only_its_own_pairs_and_both_ends_cut_them_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8 FSDP trainer ranks into 6 receivers (TP=3, 2 replicas), 24 tensors of 4 layouts.

    A trainer rank builds chunks only from itself and a receiver only to itself (every chunk
    built is recorded), the cells of each distinct pair of layouts are cut once however many
    tensors share it, and every pair's chunks are the same from either end and in the whole
    plan: the digest covers the inputs, from which every rank derives them."""
    import wtcore.sharded.plan as plan_module
    from wtcore.sharded.plan import PlannedRound

    shapes = {"q": (48, 16), "o": (16, 48), "norm": (16,), "emb": (50, 16)}
    kinds = {"q": "column", "o": "row", "norm": "replicated", "emb": "vocab"}
    metas = [
        ParamMeta(f"layers.{i}.{k}", torch.float32, s) for i in range(6) for k, s in shapes.items()
    ]
    src = {m.name: Layout.placed(m.shape, (8,), (Shard(0),)) for m in metas}
    tp = {k: tp_layout(s, kinds[k], 3) for k, s in shapes.items()}
    dst = {m.name: Layout(m.shape, tp[m.name.split(".")[-1]].boxes * 2) for m in metas}
    wire = PlannedRound.make(metas, src, dst).to_wire()
    built: list[tuple[int, int]] = []
    cuts = 0
    chunk, plan_tensor_ = plan_module.Chunk, plan_module.plan_tensor

    def counted_chunk(*args: object) -> Chunk:
        built.append((args[1], args[2]))  # type: ignore[arg-type]
        return chunk(*args)  # type: ignore[arg-type]

    def counted_plan_tensor(*args: object, **kwargs: object) -> list[Chunk]:
        nonlocal cuts
        cuts += 1
        return plan_tensor_(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "Chunk", counted_chunk)
    monkeypatch.setattr(plan_module, "plan_tensor", counted_plan_tensor)
    whole = PlannedRound.from_wire(wire).plan
    every = {p: whole.pair(*p) for p in whole.pairs()}
    assert len(every) == 8 * 6
    for s in range(8):
        built.clear()
        cuts = 0
        mine = PlannedRound.make(metas, src, dst).plan
        assert mine.digest() == wire["digest"]
        assert {p: mine.pair(*p) for p in mine.pairs(src=s)} == {
            p: c for p, c in every.items() if p[0] == s
        }
        assert {src_ for src_, _ in built} == {s}, "a trainer rank built another rank's chunk"
        assert cuts == len(shapes)  # once per pair of layouts, not once per tensor
    for d in range(6):
        built.clear()
        theirs = PlannedRound.from_wire(wire).plan
        assert {p: theirs.pair(*p) for p in theirs.pairs(dst=d)} == {
            p: c for p, c in every.items() if p[1] == d
        }
        assert {dst_ for _, dst_ in built} == {d}, "a receiver built another receiver's chunk"
        assert theirs.nbytes(dst=d) == sum(
            4 * volume(b) for b in (dst[m.name].boxes[d] for m in metas) if b
        )
