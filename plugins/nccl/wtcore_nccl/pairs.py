"""Sharded rounds: one group of M trainer ranks + N receivers per round, point to point.

Trainer rank ``r`` is group rank ``r``, receiver ``d`` group rank ``M + d``. Each rank posts its
pairs' operations from one thread (NCCL forbids point-to-point calls on one communicator from
several threads), step by step in the schedule every rank computes from the plan
(:func:`wtcore_kit.sharded.schedule.schedule_pairs`). No frame headers: both ends take every
size from the same plan and terms (:func:`check_terms`). See docs/nccl.md, "Sharded rounds".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from wtcore.buckets import as_bytes
from wtcore.errors import PayloadError
from wtcore.sharded.layout import is_int, region
from wtcore_channel.pipeline import wait_work
from wtcore_kit.sharded.pairs import pack_pair
from wtcore_kit.sharded.schedule import pair_cuts, schedule_pairs
from wtcore_nccl.config import _SECRET

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


@dataclass
class GroupUpdate:
    """The round's group: its rendezvous ``secret`` and how many ``trainer_ranks`` it has."""

    secret: str
    trainer_ranks: int

    def checked(self, ranks: int) -> GroupUpdate:
        """This update, checked against a plan of ``ranks`` trainer ranks."""
        if not isinstance(self.secret, str) or not _SECRET.fullmatch(self.secret):
            raise PayloadError("update_info.group.secret: expected 32 to 128 lowercase hex digits")
        if not is_int(self.trainer_ranks) or self.trainer_ranks != ranks:
            raise PayloadError(
                f"update_info.group.trainer_ranks: the plan has {ranks} trainer ranks, got "
                f"{self.trainer_ranks!r}"
            )
        return self


class RoundTerms(NamedTuple):
    """What every rank of a round must share for its sizes and schedule to be the receivers'."""

    digest: str
    packed_buffer_size_bytes: int
    packed_num_buffers: int


def check_terms(ours: RoundTerms, rank0: RoundTerms, rank: int) -> None:
    """Refuse a trainer rank whose terms differ from rank 0's, which the receivers follow: it
    would send other sizes than they post receives for, or in other steps."""
    for field, mine, theirs in zip(RoundTerms._fields, ours, rank0, strict=True):
        if mine != theirs:
            raise PayloadError(
                f"trainer rank {rank}: its {field} is {mine!r}, trainer rank 0's (which the "
                f"receivers follow) is {theirs!r}; every trainer rank of a sharded round must "
                "plan, cut and schedule its pairs alike (refused before any byte moved)"
            )


class BatchOp(NamedTuple):
    """One send (``send``) or receive of ``tensor`` with group rank ``peer``, named ``what``."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    what: str


def post_batch(pg: Any, ops: Sequence[BatchOp]) -> list[tuple[Any, str]]:
    """Post ``ops`` as one batch, as ``torch.distributed.batch_isend_irecv`` does (which takes
    only groups of torch's default world): one NCCL group where the backend coalesces, one by
    one otherwise. Returns each work with what it names."""
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
    """One all-reduce on every rank: NCCL forms its communicator at a group's first operation,
    which must involve every rank, and a rank with no pair in the round would never join."""
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
    """Trainer rank ``rank``: send its pairs of ``planned`` from its own parts ``local``, step
    by step. ``poll`` raises to give up (rank 0: the receivers' ``update_weights`` failed)."""
    import torch

    m = planned.senders[0].world_size if planned.senders else 0
    dev = torch.empty(0, device=device).device
    cuts, steps = _steps(planned, buffer_size_bytes, buffers)
    mine = [b for (s, _), bs in cuts.items() if s == rank for b, _ in bs]
    size = max((b.nbytes for b in mine if b.nbytes <= buffer_size_bytes), default=0)
    pool: list[torch.Tensor] = []  # at most `buffers`, allocated as steps need them
    works: list[tuple[Any, str]] = []
    sent = 0
    try:
        with stats.phase("wire"), _on(dev):
            _form(group, dev, timeout_s, poll)
            for t, step in enumerate(steps):
                ops, used, nbytes = [], 0, 0
                for op in (op for op in step if op.src == rank):
                    bucket, chunks = cuts[(op.src, op.dst)][op.bucket]
                    data = _in_place(bucket, chunks, local, dev)
                    if data is None and bucket.nbytes > size:  # a part larger than a buffer
                        own = torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev)
                        data = pack_pair(bucket, chunks, local, own)
                    elif data is None:
                        while len(pool) <= used:  # at most `buffers` (the schedule's bound)
                            pool.append(torch.empty(size, dtype=torch.uint8, device=dev))
                        data = pack_pair(bucket, chunks, local, pool[used])
                        used += 1
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
    """Receiver ``rank``: receive every sender's buckets, step by step, each into a buffer of
    exactly its planned size, and assemble them. ``poll`` raises to give up."""
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
