"""The schedule of a sharded round's buckets (:mod:`wtcore_kit.sharded.schedule`), a pure function.

What makes it safe to run every rank's pairs from one thread in batches: every (pair, bucket)
exactly once, each pair's buckets in order, at most ``per_rank`` operations per trainer rank
and per receiver in any step, and the same steps on every rank (the receivers compute them
from the plan as decoded from the wire, the trainer ranks from their own).
"""

from __future__ import annotations

import random

import pytest

from wtcore.meta import ParamMeta
from wtcore.sharded.plan import PlannedRound
from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
from wtcore.testing.sharded_contract import BUFFER, CASES, RULES, trainer_layouts, whole
from wtcore_kit.sharded.schedule import Op, pair_cuts, schedule_pairs


def _check(counts: list[tuple[int, int, int]], per_rank: int, steps: list[list[Op]]) -> None:
    seen: dict[tuple[int, int], list[int]] = {}
    for step in steps:
        assert step, "no step is empty"
        sends: dict[int, int] = {}
        recvs: dict[int, int] = {}
        for op in step:
            seen.setdefault((op.src, op.dst), []).append(op.bucket)
            sends[op.src] = sends.get(op.src, 0) + 1
            recvs[op.dst] = recvs.get(op.dst, 0) + 1
        assert max(sends.values()) <= per_rank and max(recvs.values()) <= per_rank, step
    # every (pair, bucket) exactly once, in order (across steps and within one)
    assert seen == {(s, d): list(range(n)) for s, d, n in counts if n}


def _random_counts(rng: random.Random) -> list[tuple[int, int, int]]:
    m, n = rng.randint(1, 5), rng.randint(1, 5)
    pairs = [(s, d) for s in range(m) for d in range(n) if rng.random() < 0.7]
    return [(s, d, rng.choice([0, 1, 2, 3, 7, 20])) for s, d in pairs]


@pytest.mark.parametrize("seed", range(60))
def test_every_bucket_once_in_order_within_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    counts = _random_counts(rng)
    per_rank = rng.randint(1, 4)
    steps = schedule_pairs(counts, per_rank)
    _check(counts, per_rank, steps)
    assert schedule_pairs(list(counts), per_rank) == steps  # a pure function of its input


def test_pairs_share_a_rank_s_buffers_and_take_turns() -> None:
    """Trainer rank 0 to three receivers with 2 buffers: each step serves two of them, the
    next step starting one pair further, so no receiver waits for the others to finish."""
    steps = schedule_pairs([(0, 0, 2), (0, 1, 2), (0, 2, 2)], 2)
    assert steps == [
        [Op(0, 0, 0), Op(0, 1, 0)],
        [Op(0, 1, 1), Op(0, 2, 0)],
        [Op(0, 2, 1), Op(0, 0, 1)],
    ]


def test_one_pair_fills_its_ranks_buffers_with_consecutive_buckets() -> None:
    assert schedule_pairs([(1, 0, 5)], 2) == [
        [Op(1, 0, 0), Op(1, 0, 1)],
        [Op(1, 0, 2), Op(1, 0, 3)],
        [Op(1, 0, 4)],
    ]


def test_nothing_to_send_is_no_step_and_a_bound_below_one_is_refused() -> None:
    assert schedule_pairs([], 2) == [] and schedule_pairs([(0, 0, 0)], 2) == []
    with pytest.raises(ValueError, match="at least 1"):
        schedule_pairs([(0, 0, 1)], 0)


@pytest.mark.parametrize(
    ("m", "n", "kind", "tp"), CASES, ids=[f"{m}to{n}-{k}" for m, n, k, _ in CASES]
)
def test_every_rank_computes_the_same_steps_from_the_plan(
    m: int, n: int, kind: str, tp: bool
) -> None:
    """The trainer's plan and a receiver's (decoded from the wire, planned again) cut into
    the same buckets and the same steps; the suite's cases, 2 buffers."""
    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    reports = [TPLayout(r, n, RULES) if tp else None for r in range(n)]
    trainer = PlannedRound.make(metas, trainer_layouts(kind, m), receiver_layouts(reports, metas))
    receiver = PlannedRound.from_wire(trainer.to_wire())
    cuts = [pair_cuts(p, BUFFER) for p in (trainer, receiver)]
    counts = [[(s, d, len(bs)) for (s, d), bs in c.items()] for c in cuts]
    assert counts[0] == counts[1]
    steps = [schedule_pairs(c, 2) for c in counts]
    assert steps[0] == steps[1]
    _check(counts[0], 2, steps[0])
    assert sum(map(len, steps[0])) == sum(n for *_, n in counts[0]) > 0
    assert all(b.nbytes <= BUFFER for bs in cuts[0].values() for b, _ in bs)
