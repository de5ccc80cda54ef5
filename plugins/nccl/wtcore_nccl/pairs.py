"""Sharded rounds over one process group of M trainer ranks + N receivers, point to point.

Why one group of M + N, formed per round: a sharded trainer's ranks other than 0 are not
part of the handshake's group (1 + N), and which rank sends to which receiver is the
round's plan. So after the plan every trainer rank ``r`` joins as group rank ``r`` and
every receiver ``d`` as group rank ``M + d``, through rank 0's rendezvous store under a
fresh secret drawn for the round (:func:`wtcore_nccl.group.join_group`); the group is
released when the round ends. It is not kept for the next round: that would cost a
second, long-lived process group on every trainer rank and receiver, and a way to drop it
on all of them after a failure; on gloo it forms in milliseconds. On NCCL the communicator's
init costs seconds per round (docs/nccl.md, "Sharded rounds"). Every rank first takes part
in one tiny all-reduce (:func:`_form`): NCCL builds its communicator lazily at a group's
first operation, which must involve every rank of the group, and a rank with no pair in the
round would otherwise never join it.

Why one thread, in steps: NCCL does not allow point-to-point calls on one communicator from
several threads, so each rank issues every one of its pairs' sends (a trainer rank) or
receives (a receiver) from the calling thread, following one schedule that every rank
computes from the same plan (:func:`wtcore_kit.sharded.schedule.schedule_pairs`, where the reason it
cannot deadlock is). A rank posts its operations of a step as one batch (:func:`post_batch`),
waits for them, and goes on to its next step; it skips the steps it takes no part in. No rank
has more than ``packed_num_buffers`` buckets in a step, so a trainer rank packs them into at
most that many pooled buffers, whatever the number of receivers, and a receiver receives into
as many of its own and hands each bucket to its
:class:`~wtcore_kit.sharded.pairs.PairAssembler` (sender, order and size checked) before it
reuses the buffer.

Why not ``torch.distributed.batch_isend_irecv`` itself: it takes only groups registered in
torch's global world (it maps every peer to a global rank), and this group deliberately is
not (the transfer group never calls ``init_process_group``; a trainer's default group is its
own). :func:`post_batch` does what it does, on the group object: the step's operations
grouped into one NCCL group where the backend coalesces them (NCCL), posted one by one where
it does not (gloo, whose sends and receives each proceed on their own). So the schedule, the
packing, the buffers and the checks that gloo runs here are the ones NCCL runs.

Why no frame header before each bucket (whole-tensor rounds keep theirs): every receive is
posted with the size the plan gives, and every send has that size, because both ends cut
each pair into buckets by the one bucket rule from the same plan (each receiver compares its
digest with rank 0's when the plan arrives), the same bucket size and the same number of
buffers (the receivers have rank 0's in their init info; every other trainer rank compares
its own with rank 0's before any group forms, :func:`check_terms`). A header would only
repeat what both ends already know, and on NCCL it would cost a device-to-host read and a
round trip per bucket (the receiver must read it before posting the receive) and keep a
step's operations from being one group. What the header guarded against on gloo (a
receiving process aborted by a message longer than its receive) is thus excluded before
anything moves, and so is a sender with more or fewer buckets (no end header either).
Strangers cannot join: the group's keys are under the round's secret.

Devices: on NCCL every tensor must be on the communicator's device, so a trainer rank's
buffers live on its device (the engine's ``device``): packing a bucket from shards held on
the CPU stages them onto the device (the pack is that copy). A bucket of one chunk larger than
the bucket size (a part larger than the buffer) travels in place when its region is
contiguous on the device, else in a buffer of its own for its step. A receiver receives into
buffers on its channel device and copies each chunk into its target (the sink's tensors,
wherever they live).

Failures: every wait is bounded by the timeout (:func:`wtcore_channel.pipeline.wait_work`),
polls between short waits (rank 0: the receivers' ``update_weights`` failed; a receiver: an
abort or a shutdown) and names the bucket, the trainer rank and the receiver. On a failure
the group is released without blocking on the operations left posted, so the peers' waits
fail (their connection closes) or time out; the trainer ranks then agree on the failure and
rank 0 aborts the receivers, which publish nothing of the round.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from wtcore.buckets import as_bytes
from wtcore.errors import PayloadError
from wtcore.sharded.layout import is_int, region
from wtcore_channel.pipeline import wait_work
from wtcore_kit.sharded.pairs import pack_pair
from wtcore_kit.sharded.schedule import pair_cuts, schedule_pairs

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.sharded.plan import Chunk, PlannedRound
    from wtcore.stats import TransferStats
    from wtcore_kit.sharded.pairs import PairAssembler
    from wtcore_kit.sharded.schedule import Op
    from wtcore_nccl.group import Group

__all__ = [
    "BatchOp",
    "GroupUpdate",
    "RoundTerms",
    "check_terms",
    "post_batch",
    "receive_pairs",
    "send_pairs",
]

_SECRET = re.compile(r"[0-9a-f]{32,128}")


@dataclass
class GroupUpdate:
    """The round's group: its rendezvous ``secret`` and how many ``trainer_ranks`` it has."""

    secret: str
    trainer_ranks: int

    def checked(self, ranks: int) -> GroupUpdate:
        """This update, checked against a plan of ``ranks`` trainer ranks (a ``PayloadError``
        naming the field)."""
        if not isinstance(self.secret, str) or not _SECRET.fullmatch(self.secret):
            raise PayloadError("update_info.group.secret: expected 32 to 128 lowercase hex digits")
        if not is_int(self.trainer_ranks) or self.trainer_ranks != ranks:
            raise PayloadError(
                f"update_info.group.trainer_ranks: the plan has {ranks} trainer ranks, got "
                f"{self.trainer_ranks!r}"
            )
        return self


class RoundTerms(NamedTuple):
    """What every rank of a round must share for its sizes and schedule to be the receivers':
    the plan's digest, the bucket size and the number of buffers."""

    digest: str
    packed_buffer_size_bytes: int
    packed_num_buffers: int


def check_terms(ours: RoundTerms, rank0: RoundTerms, rank: int) -> None:
    """Refuse, naming the field and both values, a trainer rank whose terms differ from rank
    0's, which the receivers follow (its init info, its plan): it would send other sizes
    than they post receives for, or in other steps."""
    for field, mine, theirs in zip(RoundTerms._fields, ours, rank0, strict=True):
        if mine != theirs:
            raise PayloadError(
                f"trainer rank {rank}: its {field} is {mine!r}, trainer rank 0's (which the "
                f"receivers follow) is {theirs!r}; every trainer rank of a sharded round must "
                "plan, cut and schedule its pairs alike (refused before any byte moved)"
            )


class BatchOp(NamedTuple):
    """One send (``send``) or receive of ``tensor`` with group rank ``peer``; ``what`` names
    it in errors."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    what: str


def post_batch(pg: Any, ops: Sequence[BatchOp]) -> list[tuple[Any, str]]:
    """Post ``ops`` as one batch, as ``torch.distributed.batch_isend_irecv`` does: one NCCL
    group where the backend coalesces (one work, named after every op), one by one otherwise
    (a work per op). Returns each work with what it names."""
    if not ops:
        return []

    def post(op: BatchOp) -> Any:
        return (pg.send if op.send else pg.recv)([op.tensor], op.peer, op.tag)

    if pg.supports_coalescing:  # pragma: no cover - NCCL, needs CUDA
        pg._start_coalescing()
        try:
            for op in ops:
                post(op)
        finally:
            work = pg._end_coalescing()
        return [(work, "; ".join(op.what for op in ops))] if work is not None else []
    return [(post(op), op.what) for op in ops]


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """NCCL's batches need the current CUDA device to be the communicator's."""
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        import torch

        with torch.cuda.device(device):
            yield
    else:
        yield


def _form(
    group: Group, device: torch.device, timeout_s: float, poll: Callable[[], None] | None
) -> None:
    """One all-reduce of one element on every rank: the communicator forms here, on every
    rank at once (see the module docstring)."""
    import torch

    work = group.pg.allreduce([torch.zeros(1, device=device)])
    what = f"forming the round's group of {group.world_size} ranks (rank {group.rank})"
    wait_work(work, what=what, timeout_s=timeout_s, poll=poll)


def _wait_step(
    works: list[tuple[Any, str]], timeout_s: float, poll: Callable[[], None] | None
) -> None:
    for work, what in works:
        wait_work(work, what=what, timeout_s=timeout_s, poll=poll)


def _in_place(
    bucket: Bucket, chunks: Sequence[Chunk], local: dict[str, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """A bucket of one chunk as a flat view of its region, if contiguous on ``device``."""
    if len(chunks) != 1 or bucket.nbytes != chunks[0].nbytes:
        return None
    part = local.get(chunks[0].name)
    if part is None:
        return None  # pack_pair names it
    view = region(part, chunks[0].src_box)
    return as_bytes(view) if view.is_contiguous() and view.device == device else None


def _steps(
    planned: PlannedRound, buffer_size_bytes: int, buffers: int
) -> tuple[dict[tuple[int, int], list[tuple[Bucket, list[Chunk]]]], list[list[Op]]]:
    cuts = pair_cuts(planned, buffer_size_bytes)
    counts = [(s, d, len(bs)) for (s, d), bs in cuts.items()]
    return cuts, schedule_pairs(counts, buffers)


def send_pairs(
    planned: PlannedRound,
    local: dict[str, torch.Tensor],
    stats: TransferStats,
    group: Group,
    *,
    rank: int,
    buffers: int,
    buffer_size_bytes: int,
    device: str,
    timeout_s: float,
    poll: Callable[[], None] | None,
) -> None:
    """Trainer rank ``rank`` (group rank ``rank``): send its pairs of ``planned`` from its
    own parts ``local``, receiver ``d`` being group rank ``trainer ranks + d``, step by step.
    ``poll`` raises to give up (rank 0: the receivers' ``update_weights`` failed)."""
    import torch

    m = planned.senders[0].world_size if planned.senders else 0
    dev = torch.empty(0, device=device).device
    cuts, steps = _steps(planned, buffer_size_bytes, buffers)
    mine = [b for (s, _), bs in cuts.items() if s == rank for b, _ in bs]
    size = max((b.nbytes for b in mine if b.nbytes <= buffer_size_bytes), default=0)
    pool: list[torch.Tensor] = []  # at most `buffers`, allocated as steps need them
    allocated = 0
    works: list[tuple[Any, str]] = []
    sent = 0
    try:
        with stats.phase("wire"), _on(dev):
            _form(group, dev, timeout_s, poll)
            for t, step in enumerate(steps):
                ops, taken, nbytes = [], [], 0
                for op in (op for op in step if op.src == rank):
                    bucket, chunks = cuts[(op.src, op.dst)][op.bucket]
                    data = _in_place(bucket, chunks, local, dev)
                    if data is None and bucket.nbytes > size:  # a part larger than a buffer
                        own = torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev)
                        data = pack_pair(bucket, chunks, local, own)
                    elif data is None:
                        if not pool:
                            assert allocated < buffers  # the schedule's bound
                            pool.append(torch.empty(size, dtype=torch.uint8, device=dev))
                            allocated += 1
                        taken.append(pool.pop())
                        data = pack_pair(bucket, chunks, local, taken[-1])
                    what = (
                        f"step {t}: bucket {op.bucket} of trainer rank {rank} to receiver {op.dst}"
                    )
                    ops.append(BatchOp(True, data, m + op.dst, op.bucket, what))
                    nbytes += bucket.payload_nbytes
                if not ops:
                    continue
                works = post_batch(group.pg, ops)
                _wait_step(works, timeout_s, poll)
                works = []
                pool.extend(taken)
                sent += nbytes
                stats.num_buckets += len(ops)
    except BaseException:
        group.release([w for w, _ in works])  # not blocking on sends a failed peer never took
        raise
    stats.bytes_sent = sent


def receive_pairs(
    assembler: PairAssembler,
    group: Group,
    *,
    rank: int,
    buffers: int,
    buffer_size_bytes: int,
    device: str,
    timeout_s: float,
    poll: Callable[[], None],
) -> None:
    """Receiver ``rank`` (group rank ``trainer ranks + rank``): receive every sender's
    buckets, step by step, each into a buffer of exactly its planned size, and assemble them.

    ``poll`` runs between short waits and raises to give up (an abort, a shutdown). On a
    failure the group is released without blocking on the receives left posted."""
    import torch

    dev = torch.empty(0, device=device).device
    _, steps = _steps(assembler.planned, buffer_size_bytes, buffers)
    mine = [b for s in assembler.senders() for b, _ in assembler.buckets_from(s)]
    size = max((b.nbytes for b in mine if b.nbytes <= buffer_size_bytes), default=0)
    pool: list[torch.Tensor] = []  # at most `buffers`, allocated as steps need them
    works: list[tuple[Any, str]] = []
    try:
        with _on(dev):
            _form(group, dev, timeout_s, poll)
            for t, step in enumerate(steps):
                ops, views = [], []
                for i, op in enumerate(op for op in step if op.dst == rank):
                    bucket, _ = assembler.buckets_from(op.src)[op.bucket]
                    if bucket.nbytes > size:  # a part larger than a buffer: one of its own
                        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev)
                    else:
                        while len(pool) <= i:  # at most `buffers` (the schedule's bound)
                            pool.append(torch.empty(size, dtype=torch.uint8, device=dev))
                        buf = pool[i]
                    view = buf[: bucket.nbytes]  # the plan's size, never the sender's
                    what = f"step {t}: bucket {op.bucket} from trainer rank {op.src}"
                    ops.append(BatchOp(False, view, op.src, op.bucket, what))
                    views.append((op.src, op.bucket, view))
                if not ops:
                    continue
                works = post_batch(group.pg, ops)
                _wait_step(works, timeout_s, poll)
                works = []
                assembler.take(views)  # sender, order and size checked before a byte lands
    except BaseException:
        group.release([w for w, _ in works])
        raise
