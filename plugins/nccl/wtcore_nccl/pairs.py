"""Sharded rounds over one process group of M trainer ranks + N receivers, point to point.

Why one group of M + N, formed per round: a sharded trainer's ranks other than 0 are not
part of the handshake's group (1 + N), and which rank sends to which receiver is the
round's plan. So after the plan every trainer rank ``r`` joins as group rank ``r`` and
every receiver ``d`` as group rank ``M + d``, through rank 0's rendezvous store under a
fresh secret drawn for the round (:func:`wtcore_nccl.group.join_group`); the group is
released when the round ends. It is not kept for the next round: that would cost a
second, long-lived process group on every trainer rank and receiver, and a way to drop it
on all of them after a failure; on gloo it forms in milliseconds. On NCCL the communicator's
init costs seconds per round (docs/nccl.md, "Sharded rounds").

Each pair's buckets go by ``send``/``recv`` on a thread of its own at both ends. Every bucket
is preceded by a fixed-size header (:mod:`wtcore_channel.frames`), which the receiver checks
against its plan *before* it posts the bucket's receive: gloo aborts the receiving process
when a message is longer than the posted receive. A pair ends with an end header, so a
sender with more buckets than planned is refused too. A sender packs a pair's next bucket
into one of its ``packed_num_buffers`` shared buffers (no rank holds more, whatever the
number of receivers); a receiver reads each sender's buckets into one buffer of its own and
hands each to its :class:`~wtcore_kit.pairs.PairAssembler` (sender, order and size checked).
"""

from __future__ import annotations

import queue
import re
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore.layout import is_int
from wtcore_channel.frames import HEADER_WORDS, check_header, make_header
from wtcore_channel.pipeline import wait_work
from wtcore_channel.threads import run_all
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.pairs import pack_pair, pair_buckets

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.plan import Chunk, PlannedRound
    from wtcore.stats import TransferStats
    from wtcore_kit.pairs import PairAssembler
    from wtcore_nccl.group import Group

__all__ = ["GroupUpdate", "receive_pairs", "send_pairs"]

_SECRET = re.compile(r"[0-9a-f]{32,128}")
#: The tag of every pair's messages (each pair has its own peer, so one tag is enough).
_TAG = 0


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


class _Cut:
    """Tells every pair's waits to give up (the first failure of a rank's pairs)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self) -> None:
        self.event.set()

    def poll(self) -> None:
        if self.event.is_set():
            raise TransferError("another pair of this rank failed")


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
    own parts ``local``, receiver ``d`` being group rank ``trainer ranks + d``. ``poll``
    raises to give up (rank 0: the receivers' ``update_weights`` failed)."""
    import torch

    m = planned.senders[0].world_size if planned.senders else 0
    pairs = {
        d: pair_buckets(planned, rank, d, buffer_size_bytes)
        for s, d in planned.plan.pairs()
        if s == rank
    }
    largest = max((b.nbytes for bs in pairs.values() for b, _ in bs), default=0)
    pool: queue.Queue[torch.Tensor] = queue.Queue()
    for _ in range(min(buffers, sum(map(len, pairs.values())))):
        pool.put(torch.empty(largest, dtype=torch.uint8, device=device))
    sent = [0]
    lock = threading.Lock()
    cut = _Cut()
    posted: list[Any] = []

    def send(t: torch.Tensor, d: int) -> Any:
        work = group.pg.send([t], m + d, _TAG)
        with lock:
            posted.append(work)
        return work

    def pair(d: int, buckets: list[tuple[Bucket, list[Chunk]]]) -> None:
        inflight: deque[tuple[list[Any], torch.Tensor, torch.Tensor, str]] = deque()

        def settle() -> None:
            works, buf, _header, what = inflight.popleft()  # the header lives until sent
            for w in works:
                wait_work(w, what=what, timeout_s=timeout_s, poll=cut.poll)
            pool.put(buf)

        for k, (bucket, chunks) in enumerate(buckets):
            while inflight and (len(inflight) >= 2 or pool.empty()):
                settle()
            try:
                buf = pool.get(timeout=timeout_s)
            except queue.Empty:
                raise TransferTimeoutError(
                    f"trainer rank {rank}: no free buffer for receiver {d} within {timeout_s:g} s"
                ) from None
            filled = pack_pair(bucket, chunks, local, buf)
            header = make_header(k, filled, device, checksum=False)
            what = f"bucket {k} of trainer rank {rank} to receiver {d}"
            inflight.append(([send(header, d), send(filled, d)], buf, header, what))
            with lock:
                sent[0] += bucket.payload_nbytes
                stats.num_buckets += 1
        while inflight:
            settle()
        end_header = make_header(len(buckets), None, device)
        what = f"the end header of trainer rank {rank} to receiver {d}"
        wait_work(send(end_header, d), what=what, timeout_s=timeout_s, poll=cut.poll)

    calls = [
        BackgroundCall(pair, d, bs, name=f"wtcore-nccl-pair-{rank}-{d}") for d, bs in pairs.items()
    ]
    try:
        with stats.phase("wire"):
            run_all(calls, cut, timeout_s, poll)
    except BaseException:
        group.release(posted)  # without blocking on the sends a failed receiver never took
        raise
    stats.bytes_sent = sent[0]


def receive_pairs(
    assembler: PairAssembler,
    group: Group,
    *,
    rank: int,
    device: str,
    timeout_s: float,
    poll: Callable[[], None],
) -> None:
    """Receiver ``rank`` (group rank ``trainer ranks + rank``): receive every sender's
    buckets, each after its header was checked against the plan, and assemble them.

    ``poll`` runs between short waits and raises to give up (an abort, a shutdown). On a
    failure the group is released without blocking on the receives left posted."""
    import torch

    lock = threading.Lock()
    cut = _Cut()
    posted: list[Any] = []

    def recv(t: torch.Tensor, s: int, what: str) -> None:
        work = group.pg.recv([t], s, _TAG)
        with lock:
            posted.append(work)
        wait_work(work, what=what, timeout_s=timeout_s, poll=cut.poll)

    def pull(s: int) -> None:
        buckets = assembler.buckets_from(s)
        buf = torch.empty(max(b.nbytes for b, _ in buckets), dtype=torch.uint8, device=device)
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device)
        for k, (bucket, _) in enumerate(buckets):
            what = f"bucket {k} from trainer rank {s}"
            recv(header, s, f"the header of {what}")
            check_header(header, index=k, nbytes=bucket.nbytes, what=what)  # before the receive
            view = buf[: bucket.nbytes]
            recv(view, s, what)
            with lock:
                assembler.take([(s, k, view)])
        what = f"the end of trainer rank {s}'s buckets"
        recv(header, s, what)
        check_header(header, index=len(buckets), nbytes=0, what=what)

    calls = [
        BackgroundCall(pull, s, name=f"wtcore-nccl-pull-{s}-{rank}") for s in assembler.senders()
    ]
    try:
        run_all(calls, cut, timeout_s, poll)
    except BaseException:
        group.release(posted)
        raise
