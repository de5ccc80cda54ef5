"""The relay chain (``topology="chain"``): each receiver hands every message on to the next.

Ranks ``0 -> 1 -> ... -> world_size - 1``, every hop one of the engine's streams with CRCs.
Handshake: every worker connects to the sender; each rank but the last tells it where it
listens, and the sender passes that on to the next rank, keeping rank 1's lanes only
(docs/tcp.md, "The chain").
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore_channel.listen import listen_on
from wtcore_kit.concurrency import BackgroundCall
from wtcore_tcp.streams import Stream, _recv_exact, accept_lanes, connect_lanes

__all__ = ["ROLES", "accept_chain", "connect_chain"]

ROLES = ("the previous rank of the chain", "the next rank of the chain")
#: A rank's ``host port``, NUL-padded, as it tells the sender on its first lane.
_ADDRESS_BYTES = 64


def accept_chain(
    listener: socket.socket,
    *,
    world_size: int,
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> Stream:
    """The sender's end: the stream to rank 1, once every rank learnt its previous one."""
    lanes = accept_lanes(
        listener, ranks=range(1, world_size), token=token, timeout_s=timeout_s, poll=poll
    )
    try:
        deadline, block = time.monotonic() + timeout_s, memoryview(bytearray(_ADDRESS_BYTES))
        for rank in range(2, world_size):
            try:
                _recv_exact(lanes[(rank - 1, 0)], block, deadline)
            except (OSError, TransferError) as e:
                raise TransferError(f"rank {rank - 1} never said where it listens: {e}") from e
            lanes[(rank, 0)].sendall(block)
    except BaseException:
        for sock in lanes.values():
            sock.close()
        raise
    for key in [k for k in lanes if k[0] != 1]:
        lanes.pop(key).close()
    return Stream(0, lanes, timeout_s, up=None, roles=ROLES, crc=True)


def connect_chain(
    address: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> Stream:
    """Rank ``rank``'s hops of the chain, set up through the sender at ``address:port``."""
    lanes = connect_lanes(address, port, rank=rank, token=token, timeout_s=timeout_s, poll=poll)
    accepting = listener = None
    try:
        if rank + 1 < world_size:
            host = str(lanes[(0, 0)].getsockname()[0])
            listener = listen_on(host, 0, f"rank {rank}'s chain port", field="")
            accepting = BackgroundCall(
                accept_lanes, listener, ranks=[rank + 1], token=token, timeout_s=timeout_s,
                me=f"rank {rank}", name="wtcore-tcp-chain-accept",
            )  # fmt: skip
            published = f"{host} {listener.getsockname()[1]}".encode()
            lanes[(0, 0)].sendall(published.ljust(_ADDRESS_BYTES, b"\0"))
        if rank > 1:
            host, at = _published(lanes[(0, 0)], rank - 1, timeout_s, poll)
            for sock in lanes.values():
                sock.close()
            lanes = connect_lanes(
                host, at, rank=rank, token=token, timeout_s=timeout_s, poll=poll,
                peer=rank - 1, name=f"rank {rank - 1} ({ROLES[0]})",
            )  # fmt: skip
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
    return Stream(rank, lanes, timeout_s, up=rank - 1, roles=ROLES, crc=True)


def _published(
    sock: socket.socket, peer: int, timeout_s: float, poll: Callable[[], None] | None
) -> tuple[str, int]:
    """Rank ``peer``'s chain address, as the sender passed it on, checked before it is used."""
    block, deadline = bytearray(_ADDRESS_BYTES), time.monotonic() + timeout_s
    try:
        while not select.select([sock], [], [], 0.05)[0]:  # short waits, polling between
            if poll is not None:
                poll()
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(f"timed out after {timeout_s:g} s")
        _recv_exact(sock, memoryview(block), deadline)
    except (OSError, TransferError) as e:
        kind = TransferTimeoutError if isinstance(e, TimeoutError) else TransferError
        raise kind(f"rank {peer} ({ROLES[0]}) published no chain address: {e}") from e
    text = bytes(block).rstrip(b"\0").decode("utf-8", "replace")
    host, _, port = text.partition(" ")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PayloadError(f"rank {peer}'s chain address from the sender is malformed: {text!r}")
    return host, int(port)
