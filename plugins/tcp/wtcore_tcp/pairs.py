"""Sharded rounds over TCP: one stream per (trainer rank, receiver) pair, opened per round.

Why per round: which trainer rank talks to which receiver is the round's plan, and a
sharded trainer's ranks are not part of the handshake (rank 0 alone initializes the
receivers). So in every sharded round each trainer rank listens on its own ``address`` (the
port the kernel's pick, or ``port + rank``) with a fresh token; rank 0 sends the receivers
every rank's address, port and token in one ``update_weights`` (``{"senders": [...]}``, after
the plan), and each receiver connects to exactly the ranks it gets bytes from. A connection
costs a few milliseconds, against a round of many megabytes.

Each pair runs on a thread of its own at both ends, so no pair waits for another: a sender
packs a pair's next bucket into one of its ``packed_num_buffers`` shared buffers (no rank
holds more than those, whatever the number of receivers), and a receiver reads each
sender's stream into two buffers of its own and hands every bucket to its
:class:`~wtcore_kit.sharded.pairs.PairAssembler`, which checks sender, order and size. Each
message's length is read, and refused, before its bytes (:mod:`wtcore_tcp.streams`).
"""

from __future__ import annotations

import queue
import re
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, TransferTimeoutError
from wtcore.sharded.layout import is_int
from wtcore_channel.listen import listen_on
from wtcore_channel.pipeline import wait_work
from wtcore_channel.threads import run_all
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.sharded.pairs import pack_pair, pair_buckets
from wtcore_tcp.streams import Stream, accept_lanes, connect_lanes

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.sharded.plan import Chunk, PlannedRound
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats
    from wtcore_kit.sharded.pairs import PairAssembler

__all__ = ["SendersUpdate", "receive_pairs", "send_pairs"]

_TOKEN = re.compile(r"[0-9a-f]{32,128}")


@dataclass
class SendersUpdate:
    """Where every trainer rank listens in this round: ``{"address", "port", "token"}`` each."""

    senders: list[Any]

    def checked(self, ranks: int) -> list[tuple[str, int, str]]:
        """The entries, each checked (a ``PayloadError`` naming it), for ``ranks`` ranks."""
        if len(self.senders) != ranks:
            raise PayloadError(
                f"update_info.senders: the plan has {ranks} trainer ranks, got "
                f"{len(self.senders)} entries"
            )
        out = []
        for i, e in enumerate(self.senders):
            where = f"update_info.senders[{i}]"
            if not isinstance(e, dict) or set(e) != {"address", "port", "token"}:
                raise PayloadError(f"{where}: expected an object of address, port and token")
            address, port, token = e["address"], e["port"], e["token"]
            if not isinstance(address, str) or not 0 < len(address) <= 255:
                raise PayloadError(f"{where}.address: expected a host name or IP address")
            if not is_int(port) or not 0 < port < 65536:
                raise PayloadError(f"{where}.port: expected a port in [1, 65535], got {port!r}")
            if not isinstance(token, str) or not _TOKEN.fullmatch(token):
                raise PayloadError(f"{where}.token: expected 32 to 128 lowercase hex digits")
            out.append((address, int(port), token))
        return out


def _close(streams: Iterable[Stream]) -> None:
    for s in streams:
        s.close()


def send_pairs(
    planned: PlannedRound,
    source: WeightSource,
    stats: TransferStats,
    *,
    rank: int,
    address: str,
    port: int,
    buffers: int,
    buffer_size_bytes: int,
    timeout_s: float,
    announce: Callable[[dict[str, Any] | None, BaseException | None], BackgroundCall[Any] | None],
) -> None:
    """Trainer rank ``rank``: stream its pairs of ``planned`` from its parts of ``source``.

    ``announce`` is called on every rank together with this rank's ``{"address", "port",
    "token"}``, or the error that kept it from listening (then it raises on every rank); on
    rank 0 it returns the ``update_weights`` call it started with every rank's entry (the
    receivers connect once they have it), whose failure ends this rank's wait for them.
    """
    import torch

    pairs = {
        d: pair_buckets(planned, rank, d, buffer_size_bytes)
        for _, d in planned.plan.pairs(src=rank)
    }
    token = secrets.token_hex(16)
    try:
        listener = listen_on(
            address, port + rank if port else 0, "a sharded round's stream", field=""
        )
    except BaseException as e:
        announce(None, e)
        raise
    try:
        entry = {"address": address, "port": int(listener.getsockname()[1]), "token": token}
        rpc = announce(entry, None)
    except BaseException:
        listener.close()
        raise

    def poll() -> None:
        if rpc is not None and rpc.error is not None:
            raise rpc.error

    streams: dict[int, Stream] = {}
    try:
        with listener:
            local = dict(source)  # after the announcement: a failure here fails every rank
            lanes = accept_lanes(
                listener,
                ranks=[d + 1 for d in pairs],
                token=token,
                timeout_s=timeout_s,
                poll=poll,
                me=f"trainer rank {rank}",
            )
        for d in pairs:
            mine = {k: v for k, v in lanes.items() if k[0] == d + 1}
            roles = ("", f"receiver {d}")
            streams[d] = Stream(0, mine, timeout_s, up=None, roles=roles)
        largest = max((b.nbytes for bs in pairs.values() for b, _ in bs), default=0)
        pool: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(min(buffers, sum(map(len, pairs.values())))):
            pool.put(torch.empty(largest, dtype=torch.uint8))
        sent = [0]
        lock = threading.Lock()

        def pair(d: int, buckets: list[tuple[Bucket, list[Chunk]]]) -> None:
            inflight: deque[tuple[Any, torch.Tensor, str]] = deque()

            def settle() -> None:
                work, buf, what = inflight.popleft()
                wait_work(work, what=what, timeout_s=timeout_s)
                pool.put(buf)

            for k, (bucket, chunks) in enumerate(buckets):
                while inflight and (len(inflight) >= 2 or pool.empty()):
                    settle()
                try:
                    buf = pool.get(timeout=timeout_s)
                except queue.Empty:
                    raise TransferTimeoutError(
                        f"trainer rank {rank}: no free buffer for receiver {d} within "
                        f"{timeout_s:g} s"
                    ) from None
                filled = pack_pair(bucket, chunks, local, buf)
                what = f"bucket {k} of trainer rank {rank} to receiver {d}"
                inflight.append((streams[d].broadcast(filled), buf, what))
                with lock:
                    sent[0] += bucket.payload_nbytes
                    stats.num_buckets += 1
            while inflight:
                settle()

        calls = [
            BackgroundCall(pair, d, bs, name=f"wtcore-tcp-pair-{rank}-{d}")
            for d, bs in pairs.items()
        ]
        with stats.phase("wire"):
            run_all(calls, lambda: _close(streams.values()), timeout_s, poll)
        stats.bytes_sent = sent[0]
    finally:
        for s in streams.values():
            s.close()
    if rpc is not None:
        with stats.phase("control"):
            rpc.result(timeout_s)


def receive_pairs(
    assembler: PairAssembler,
    senders: list[tuple[str, int, str]],
    *,
    rank: int,
    timeout_s: float,
    poll: Callable[[], None],
) -> None:
    """Receiver ``rank``: connect to every trainer rank it gets bytes from and assemble them.

    ``poll`` runs between short waits and raises to give up (an abort, a shutdown).
    """
    import torch

    lock = threading.Lock()
    streams: dict[int, Stream] = {}
    try:
        for s in assembler.senders():
            address, port, token = senders[s]
            name = f"trainer rank {s}"
            lanes = connect_lanes(
                address, port, rank=rank + 1, token=token, timeout_s=timeout_s, poll=poll,
                peer=0, name=name,
            )  # fmt: skip
            streams[s] = Stream(rank + 1, lanes, timeout_s, up=0, roles=(name, ""))

        def pull(s: int) -> None:
            buckets = assembler.buckets_from(s)
            largest = max(b.nbytes for b, _ in buckets)
            bufs = [torch.empty(largest, dtype=torch.uint8) for _ in range(min(2, len(buckets)))]
            posted: deque[tuple[int, torch.Tensor, Any]] = deque()
            nxt = 0
            for _ in buckets:
                while nxt < len(buckets) and len(posted) < len(bufs):
                    view = bufs[nxt % len(bufs)][: buckets[nxt][0].nbytes]
                    posted.append((nxt, view, streams[s].broadcast(view)))
                    nxt += 1
                k, view, work = posted.popleft()
                wait_work(work, what=f"bucket {k} from trainer rank {s}", timeout_s=timeout_s)
                with lock:
                    assembler.take([(s, k, view)])

        calls = [BackgroundCall(pull, s, name=f"wtcore-tcp-pull-{s}-{rank}") for s in streams]
        run_all(calls, lambda: _close(streams.values()), timeout_s, poll)
    finally:
        for stream in streams.values():
            stream.close()
