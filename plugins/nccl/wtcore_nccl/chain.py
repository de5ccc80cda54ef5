"""The forwarding broadcast (``broadcast="chain"``): receivers relay chunks down a chain.

A collective broadcast from the sender sends a copy of every byte per receiver, or per child
of a tree, from the sender's link: with the network as the limit, a round to ``N``
receivers takes up to ``N`` times as long as to one. Here the ranks form a chain ordered by
rank (``0 -> 1 -> ... -> world_size - 1``) and every message is cut into chunks of
:data:`CHUNK_BYTES`: rank ``k`` receives chunk ``i`` from ``k - 1`` and sends it on to
``k + 1`` while chunk ``i + 1`` is already arriving, as NCCL's ring broadcast does. Every
link carries each byte once, so the round takes about the time of one link plus one chunk
per hop.

Each :meth:`Chain.broadcast` is a point-to-point send or receive per chunk on the group's
process group, tagged with a running counter that every rank advances in the same order
(every rank broadcasts the same sequence of headers and buckets), and returns a
:class:`ChainWork` that behaves like the ``dist.Work`` of a collective broadcast for the
callers (:func:`wtcore_channel.pipeline.wait_work`, the group's reaper). Receivers post the
receives of a whole message at once; a forwarder thread per rank waits for them in order
and posts each chunk's send to the next rank as soon as it arrived, so forwarding never
waits for the engine's own thread. Framing is the caller's: headers and their size checks
travel through here like any other message.

A failure names the peer: a receive that fails or takes longer than the timeout names the
previous rank, a send the next rank, so every receiver of a broken chain reports where it
broke.

That is the chain on NCCL (CUDA). On CPU (gloo) the hops are TCP streams instead
(:func:`stream_chain`): a receiver is a relay, and gloo checks a message's length only by
aborting the receiving process when more bytes arrive than it posted, and leaves a shorter
message's tail stale without a word. The trainer's frame headers guard against a lying
trainer, but the hops after the first carry what a *receiver* forwards, and one receiver must
not be able to kill or fool the next. On a stream every message's length prefix is checked
against the receive posted for it before a byte is read, on every hop
(:mod:`wtcore_channel.stream`), and a relay that fails cuts its onward connections, so the
receivers behind it fail at once, naming it. Each rank but the last listens on its own
address (the one its gloo device uses) on a port of the kernel's choice, publishes it in the
handshake's store, and the next rank connects to it with a hello signed by the handshake's
secret.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore_channel.pipeline import ThreadWork

if TYPE_CHECKING:
    import torch

    from wtcore_channel.stream import Stream

__all__ = ["BROADCASTS", "CHUNK_BYTES", "ROLES", "Chain", "ChainWork", "stream_chain"]

#: The broadcast modes of the nccl engine: the process group's own broadcast, or this chain.
BROADCASTS: tuple[str, ...] = ("collective", "chain")
#: Bytes per chunk: small enough that filling a chain of a few hops costs little, large
#: enough that per-message overhead stays negligible (docs/benchmarks.md).
CHUNK_BYTES = 1 << 20
_TAGS = 1 << 30
#: How the chain's streams name a rank's previous and next rank in errors.
ROLES = ("the previous rank of the chain", "the next rank of the chain")
_POLL_S = 0.01


def _chunks(tensor: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """``tensor``'s bytes (it must be contiguous) as consecutive views of ``chunk_bytes``."""
    import torch

    flat = tensor.reshape(-1).view(torch.uint8)
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)] or [flat]


class ChainWork(ThreadWork):
    """One message's chunks on this rank (a :class:`~wtcore_channel.pipeline.ThreadWork`).

    The chain's threads drive it: a point-to-point ``Work`` of gloo may only be waited for
    in full (a wait that expires closes every connection of the group), so nobody polls
    them. Its failures name the previous or the next rank of the chain.
    """

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
    """This rank's end of the forwarding chain over ``pg`` (see the module docstring).

    Two daemon threads per rank: the forwarder waits for each received chunk in order and
    posts its send to the next rank; the send waiter waits for the sends in order. Both
    block only in gloo's own waits, which the group's timeout bounds.
    """

    def __init__(
        self,
        pg: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.pg: Any = pg
        self.rank = rank
        self.prev: int | None = rank - 1 if rank > 0 else None
        self.next: int | None = rank + 1 if rank + 1 < world_size else None
        self.timeout_s = timeout_s
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
        """Wait for each message's chunks in order; send each on as soon as it arrived."""
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
        """Wait for every posted send in order; a failed one fails its message."""
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
        """Stop forwarding: messages not yet relayed fail; the threads end (not joined).

        Drops this chain's reference to the process group, so the group's reaper holds the
        last one (see :func:`wtcore_nccl.group.release_group`).
        """
        self._closed.set()
        self._recvs.put(None)
        self._sends.put(None)
        self.pg = None


def stream_chain(
    store: Any,
    *,
    rank: int,
    world_size: int,
    host: str,
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> Stream:
    """This rank's hops of the chain on CPU: TCP streams (see the module docstring).

    Every rank but the last listens on ``host`` and publishes ``host port`` in ``store`` (the
    handshake's own prefix store); every rank but the first connects to its previous rank's
    published address, signing its hello with ``token``. Accepting runs on a thread while
    this rank connects, so the chain forms in one pass whatever order the ranks arrive in.
    """
    from wtcore_channel.listen import listen_on
    from wtcore_channel.stream import Stream, accept_lanes, connect_lanes
    from wtcore_kit.concurrency import BackgroundCall

    prev = rank - 1 if rank > 0 else None
    lanes: dict[tuple[int, int], Any] = {}
    accepting = None
    listener = None
    if rank + 1 < world_size:
        listener = listen_on(host, 0, f"rank {rank}'s chain port", field="gloo device ")
        store.set(f"chain/{rank}", f"{host} {listener.getsockname()[1]}")
        accepting = BackgroundCall(
            accept_lanes, listener, ranks=[rank + 1], token=token, timeout_s=timeout_s,
            me=f"rank {rank}", name="wtcore-nccl-chain-accept",
        )  # fmt: skip
    try:
        if prev is not None:
            address, port = _published(store, prev, timeout_s, poll)
            name = f"rank {prev} ({ROLES[0]})"
            up = connect_lanes(
                address,
                port,
                rank=rank,
                token=token,
                timeout_s=timeout_s,
                poll=poll,
                peer=prev,
                name=name,
            )
            lanes.update(up)
        if accepting is not None:
            deadline = time.monotonic() + timeout_s + 5.0
            while not accepting.wait(0.05):
                if poll is not None:
                    poll()
                if time.monotonic() >= deadline:
                    raise TransferTimeoutError(
                        f"rank {rank + 1} ({ROLES[1]}) never connected to rank {rank}"
                    )
            lanes.update(accepting.result(0))
    except BaseException:
        for sock in lanes.values():
            sock.close()
        raise
    finally:
        if listener is not None:
            listener.close()
    return Stream(rank, lanes, timeout_s, up=prev, roles=ROLES)


def _published(
    store: Any, peer: int, timeout_s: float, poll: Callable[[], None] | None
) -> tuple[str, int]:
    """Rank ``peer``'s chain address from the store, checked before it is used."""
    key = f"chain/{peer}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            raise TransferTimeoutError(
                f"rank {peer} ({ROLES[0]}) published no chain address within {timeout_s:g} s"
            )
        time.sleep(_POLL_S)
    text = bytes(store.get(key))[:300].decode("utf-8", "replace")
    host, _, port = text.partition(" ")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PayloadError(f"rank {peer}'s chain address in the store is malformed: {text!r}")
    return host, int(port)
