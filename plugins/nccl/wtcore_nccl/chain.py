"""The forwarding broadcast on NCCL (``broadcast="chain"``): receivers relay chunks down a chain.

Rank ``k`` receives each chunk from ``k - 1`` and sends it on to ``k + 1`` as soon as it landed,
so every link carries each byte once (docs/nccl.md, "Broadcast"). Chunks are point-to-point
messages tagged by a counter every rank advances in the same order; a forwarder thread relays
them, so forwarding never waits for the engine's thread. Framing is the caller's. NCCL only
(:func:`check_broadcast`): gloo checks a relay's message length only by aborting the receiver.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, TransferError
from wtcore_channel.pipeline import ThreadWork

if TYPE_CHECKING:
    import torch

__all__ = ["BROADCASTS", "CHUNK_BYTES", "Chain", "ChainWork", "check_broadcast"]

#: The broadcast modes of the nccl engine: the process group's own broadcast, or this chain.
BROADCASTS: tuple[str, ...] = ("collective", "chain")
#: Bytes per chunk: small enough that filling a chain of a few hops costs little, large
#: enough that per-message overhead stays negligible (docs/benchmarks.md).
CHUNK_BYTES = 1 << 20
_TAGS = 1 << 30


def check_broadcast(broadcast: str, transport: str) -> None:
    """Refuse a broadcast mode that ``transport`` does not run (naming the field)."""
    if broadcast not in BROADCASTS:
        raise PayloadError(f"broadcast: expected one of {', '.join(BROADCASTS)}, got {broadcast!r}")
    if broadcast == "chain" and transport == "gloo":
        raise PayloadError(
            "broadcast: 'chain' runs on NCCL only (a gloo relay's message lengths cannot be "
            "checked); on CPU use the tcp engine's chain (topology='chain', docs/tcp.md)"
        )


def _chunks(tensor: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """Views of ``tensor``'s bytes; it must be contiguous, or receives would land in a copy."""
    import torch

    flat = tensor.reshape(-1).view(torch.uint8)
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)] or [flat]


class ChainWork(ThreadWork):
    """One message's chunks on this rank, driven by the chain's threads (a gloo point-to-point
    ``Work`` may only be waited for in full: an expired wait closes the group's connections).
    Its failures name the previous or the next rank."""

    def fail_recv(self, i: int, n: int, error: BaseException) -> None:
        self._fail(
            f"receiving chunk {i} of {n} of {self.label} from rank {self.recv_peer} (the "
            f"previous rank of the chain) failed: {error}"
        )

    def fail_send(self, i: int, n: int, error: BaseException) -> None:
        self._fail(
            f"sending chunk {i} of {n} of {self.label} to rank {self.send_peer} (the next "
            f"rank of the chain) failed: {error}"
        )

    def pending_detail(self) -> str:
        if self.error is not None:
            return self.error
        if self.recvs_left:
            return (
                f"{self.recvs_left} chunk(s) not yet received from rank {self.recv_peer} "
                "(the previous rank of the chain)"
            )
        return (
            f"{self.sends_left} chunk(s) not yet taken by rank {self.send_peer} (the next rank "
            "of the chain)"
        )


_Job = tuple[ChainWork, list[Any], list[int], list["torch.Tensor"]]


class Chain:
    """This rank's end of the chain over ``pg``: a forwarder thread relays each received chunk
    in order, a send waiter waits for the sends in order; both block only in the process
    group's own waits, which the group's timeout bounds."""

    def __init__(
        self,
        pg: Any,
        rank: int,
        world_size: int,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.pg: Any = pg
        self.rank = rank
        self.prev: int | None = rank - 1 if rank > 0 else None
        self.next: int | None = rank + 1 if rank + 1 < world_size else None
        self.chunk_bytes = chunk_bytes
        self._tag = 0
        self._recvs: queue.Queue[_Job | None] = queue.Queue()
        self._sends: queue.Queue[tuple[ChainWork, int, int, Any] | None] = queue.Queue()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def _next_tag(self) -> int:
        tag, self._tag = self._tag, (self._tag + 1) % _TAGS
        return tag

    def _start(self) -> None:
        if self._threads:
            return
        targets = [self._send_waiter] if self.next is not None else []
        if self.prev is not None:
            targets.append(self._forwarder)
        for target in targets:
            t = threading.Thread(target=target, name=f"wtcore-nccl-chain-{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)

    def broadcast(self, tensor: torch.Tensor) -> ChainWork:
        """Start sending (rank 0) or receiving and forwarding (the others) ``tensor``."""
        pg = self.pg
        if pg is None or self._closed.is_set():
            raise TransferError("the nccl transfer group was closed")
        self._start()
        chunks = _chunks(tensor, self.chunk_bytes)
        tags = [self._next_tag() for _ in chunks]
        n = len(chunks)
        work = ChainWork(
            f"a message of {tensor.numel() * tensor.element_size()} bytes",
            recvs_left=0 if self.prev is None else n,
            sends_left=0 if self.next is None else n,
            send_peer=self.next,
            recv_peer=self.prev,
        )
        if self.prev is None:  # the sender: every chunk goes to rank 1, the chain does the rest
            assert self.next is not None
            for i, (c, t) in enumerate(zip(chunks, tags, strict=True)):
                self._sends.put((work, i, n, pg.send([c], self.next, t)))
            return work
        recvs = [pg.recv([c], self.prev, t) for c, t in zip(chunks, tags, strict=True)]
        self._recvs.put((work, recvs, tags, chunks))
        return work

    def _forwarder(self) -> None:
        while (job := self._recvs.get()) is not None:
            work, recvs, tags, chunks = job
            del job
            self._relay(work, recvs, tags, chunks)
            del work, recvs, chunks

    def _relay(
        self, work: ChainWork, recvs: list[Any], tags: list[int], chunks: list[torch.Tensor]
    ) -> None:
        n = len(chunks)
        for i, (recv, tag, chunk) in enumerate(zip(recvs, tags, chunks, strict=True)):
            if work.error is not None:
                return
            try:
                recv.wait()  # bounded by the group's timeout
            except RuntimeError as e:
                work.fail_recv(i, n, e)
                return
            pg = self.pg
            if self.next is not None:
                if pg is None or self._closed.is_set():
                    work._fail("the nccl transfer group was closed")
                    return
                try:
                    self._sends.put((work, i, n, pg.send([chunk], self.next, tag)))
                except RuntimeError as e:
                    work.fail_send(i, n, e)
                    return
            work._count(recvs=1)

    def _send_waiter(self) -> None:
        while (item := self._sends.get()) is not None:
            work, i, n, send = item
            del item
            if work.error is None:
                try:
                    send.wait()  # bounded by the group's timeout
                except RuntimeError as e:
                    work.fail_send(i, n, e)
                else:
                    work._count(sends=1)
            del work, send

    def close(self) -> None:
        """Stop forwarding (the threads end, not joined) and drop the process group, so the
        group's reaper holds the last reference (:func:`wtcore_nccl.group.release_group`)."""
        self._closed.set()
        self._recvs.put(None)
        self._sends.put(None)
        self.pg = None
