"""One schedule for a sharded round's buckets, computed identically on every rank.

Why a schedule: an engine that moves every pair of a round in steps (nccl posts each rank's
sends or receives of a step as one batch, :mod:`wtcore_nccl.pairs`; mooncake packs each
trainer rank's buckets of a step into its slots for the receivers to read,
:mod:`wtcore_mooncake.trainer`) needs the steps to agree on every rank, and no rank to hold
more buffers than it has. A batch may only wait for operations that its peers post in their
own batch of the same step: otherwise rank A's batch could wait for a receive that B posts
only after its own batch, which waits for C, which waits for A (on NCCL a batch is one grouped
kernel, so nothing of a later batch starts before it ends). So the steps come from the plan
alone, by a pure function of what every rank knows the same way (each pair's number of
buckets, in plan order, and ``packed_num_buffers``); then, step by step, every operation of
step ``t`` is matched by one of step ``t`` on its peer, and once every step before ``t`` is
done every rank of step ``t`` has posted its part of it: by induction every step completes.

Each step holds at most ``per_rank`` buckets per trainer rank and per receiver, so a rank
never needs more than ``per_rank`` buffers. A pair's buckets keep their order (bucket ``k``
never in a later step than bucket ``k + 1``, and in the same step before it), which is the
order a receiver's :class:`~wtcore_kit.sharded.pairs.PairAssembler` takes them in. Within a
step, pairs get buckets one at a time in turn, starting one pair further each step, so that a
trainer rank's receivers share its buffers and a receiver's senders share its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from wtcore.errors import PayloadError
from wtcore_kit.sharded.pairs import pair_buckets

if TYPE_CHECKING:
    from wtcore.buckets import Bucket
    from wtcore.sharded.plan import Chunk, PlannedRound

__all__ = ["Op", "PairCuts", "pair_cuts", "schedule_pairs"]

#: Every pair's buckets with their chunks, by (trainer rank, receiver), in plan order.
PairCuts = dict[tuple[int, int], list[tuple["Bucket", list["Chunk"]]]]


class Op(NamedTuple):
    """Bucket number ``bucket`` of pair (trainer rank ``src``, receiver ``dst``)."""

    src: int
    dst: int
    bucket: int


def schedule_pairs(counts: Sequence[tuple[int, int, int]], per_rank: int) -> list[list[Op]]:
    """The steps for pairs ``(src, dst, number of buckets)``, in plan order (see the module
    docstring): every bucket exactly once, each pair's in order, at most ``per_rank``
    operations per trainer rank and per receiver in any step, no step empty."""
    if per_rank < 1:
        raise PayloadError(f"packed_num_buffers: at least 1 buffer per rank, got {per_rank}")
    pairs = [(s, d, n) for s, d, n in counts if n > 0]
    nxt = [0] * len(pairs)
    left = sum(n for _, _, n in pairs)
    steps: list[list[Op]] = []
    while left:
        sends: dict[int, int] = {}
        recvs: dict[int, int] = {}
        step: list[Op] = []
        start = len(steps) % len(pairs)
        order = [*range(start, len(pairs)), *range(start)]
        added = True
        while added:  # one more bucket per pair and pass, while any rank has room
            added = False
            for i in order:
                s, d, n = pairs[i]
                if nxt[i] < n and sends.get(s, 0) < per_rank and recvs.get(d, 0) < per_rank:
                    step.append(Op(s, d, nxt[i]))
                    nxt[i] += 1
                    sends[s] = sends.get(s, 0) + 1
                    recvs[d] = recvs.get(d, 0) + 1
                    left -= 1
                    added = True
        steps.append(step)  # never empty: every rank had room at its start
    return steps


def pair_cuts(planned: PlannedRound, buffer_size_bytes: int) -> PairCuts:
    """Every pair's buckets (:func:`~wtcore_kit.sharded.pairs.pair_buckets`), as every rank
    cuts them."""
    return {(s, d): pair_buckets(planned, s, d, buffer_size_bytes) for s, d in planned.plan.pairs()}
