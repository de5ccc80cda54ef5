"""TCP streams from a sender to its receivers: the ``tcp`` engine's channel, fanned out or
relayed down its chain (:mod:`wtcore_tcp.chain`).

A message is a 16-byte prefix (magic, byte count), its bytes and, with ``crc`` (the chain),
the trainer's CRC-32 of them. A receiver reads the prefix before a byte of the message, so a
size that disagrees is refused, never an overrun; message ``k`` travels on lane ``k % LANES``,
each lane on a thread of its own at both ends. The handshake (signed hellos, no store), the
relays and their checks: docs/tcp.md. A receive never completes while its thread may still
write into the buffer.
"""

from __future__ import annotations

import hashlib
import hmac
import queue
import selectors
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError, TransferTimeoutError
from wtcore_channel.pipeline import ThreadWork, Work

if TYPE_CHECKING:
    import torch

__all__ = [
    "HELLO_S",
    "LANES",
    "RELAY_CHUNK",
    "Stream",
    "StreamWork",
    "accept",
    "accept_lanes",
    "connect",
    "connect_lanes",
]

_PREFIX = struct.Struct("<QQ")  # magic, byte count
_TRAILER = struct.Struct("<I")  # the trainer's CRC-32 of the message (a stream with ``crc``)
_MAGIC = int.from_bytes(b"wtcstrm1", "big")
_HELLO = struct.Struct("<QQQ32s")  # magic, rank, lane, token
_HELLO_MAGIC = int.from_bytes(b"wtchelo1", "big")
_ACK = b"\x01"
HELLO_S = 5.0  # how long an accepted connection may take to say hello
_GREETERS = 64  # hellos awaited at once; one more drops the oldest
_POLL_S = 0.05
#: Connections per worker: on loopback one is bound by one core of the sender's kernel.
LANES = 2
_SMALL = 1 << 16  # messages up to this size go out with their prefix in one call
RELAY_CHUNK = 1 << 20  # a relay hands a message on in pieces of this size
_IOV = 512  # buffers per sendmsg/recvmsg_into (the kernel's limit is 1024)


def _signature(token: str, rank: int, lane: int) -> bytes:
    return hmac.new(token.encode(), f"wtcore-tcp:{rank}:{lane}".encode(), hashlib.sha256).digest()


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise TransferError("the tcp engine moves contiguous CPU tensors only (use nccl on CUDA)")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy is a buffer


def _bound(sock: socket.socket, timeout_s: float) -> None:
    """Bound every blocking call on ``sock`` in the kernel (a Python-level timeout would
    split each receive into many syscalls)."""
    sec = max(0.001, timeout_s)
    tv = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock``; :class:`TransferError` if the peer closed,
    :class:`TransferTimeoutError` past ``deadline``."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO expired with nothing read
            k = -1
        if k == 0:
            raise TransferError("the connection was closed")
        if k > 0:
            got += k
        if got < n and time.monotonic() >= deadline:
            raise TransferTimeoutError(f"{got} of {n} bytes arrived in time")


def _recv_scattered(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    """:func:`_recv_exact` into ``views`` in order, :data:`_IOV` of them a call."""
    if len(views) == 1:
        _recv_exact(sock, views[0], deadline)
        return
    left = [v for v in views if len(v)]
    while left:
        want = sum(len(v) for v in left[:_IOV])
        try:
            k = sock.recvmsg_into(left[:_IOV], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:  # SO_RCVTIMEO expired with nothing read
            k = -1
        if k == 0:
            raise TransferError("the connection was closed")
        if k > 0:
            _advance(left, k)
        if k < want and time.monotonic() >= deadline:
            raise TransferTimeoutError(f"{sum(len(v) for v in left)} bytes did not arrive in time")


def _advance(views: list[memoryview], k: int) -> None:
    """Drop the first ``k`` bytes of ``views``, in place."""
    while k:
        if k >= len(views[0]):
            k -= len(views.pop(0))
        else:
            views[0] = views[0][k:]
            k = 0


def _crc(views: Iterable[memoryview], crc: int = 0) -> int:
    for v in views:
        crc = zlib.crc32(v, crc)
    return crc


def _send_gathered(
    sock: socket.socket, views: list[memoryview], total: int, trailer: bytes = b""
) -> None:
    """Write one message (prefix, ``views``, ``trailer``) straight from where its bytes lie."""
    left = [memoryview(_PREFIX.pack(_MAGIC, total)), *(v for v in views if len(v))]
    left += [memoryview(trailer)] if trailer else []
    while left:
        _advance(left, sock.sendmsg(left[:_IOV]))


def _send_message(sock: socket.socket, view: memoryview, total: int | None = None) -> None:
    """Write one message's prefix (length ``total``, default ``len(view)``) and ``view``."""
    prefix = _PREFIX.pack(_MAGIC, len(view) if total is None else total)
    if len(view) <= _SMALL:
        sock.sendall(prefix + view.tobytes())
        return
    sent = sock.sendmsg([prefix, view])
    if sent < len(prefix):
        sock.sendall(prefix[sent:])
        sent = len(prefix)
    sock.sendall(view[sent - len(prefix) :])


def _address(sock: socket.socket, *, local: bool = False) -> str:
    try:
        host, port = (sock.getsockname() if local else sock.getpeername())[:2]
    except OSError:
        return "its address" if local else "an unknown address"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


_Lane = tuple[int, int]  # (peer rank, lane)


def accept(
    listener: socket.socket,
    *,
    world_size: int,
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> Stream:
    """The sender's end of a fan-out: every lane of every worker rank whose hello is signed."""
    lanes = accept_lanes(
        listener, ranks=range(1, world_size), token=token, timeout_s=timeout_s, poll=poll
    )
    return Stream(0, lanes, timeout_s)


def accept_lanes(
    listener: socket.socket,
    *,
    ranks: Iterable[int],
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
    me: str = "the sender",
) -> dict[_Lane, socket.socket]:
    """Keep every lane of every rank in ``ranks`` whose hello is signed; drop the rest.

    ``poll`` runs between short waits (it raises to give up). Silent connections are dropped
    oldest first, so a flood of strangers cannot keep a worker out (dropping the newest reset
    the worker that came after 64 of them).
    """
    expected = frozenset(ranks)
    deadline = time.monotonic() + timeout_s
    peers: dict[_Lane, socket.socket] = {}
    unread: dict[socket.socket, tuple[bytearray, float]] = {}  # oldest first: hello, expiry
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)

    def drop(conn: socket.socket) -> None:
        del unread[conn]
        selector.unregister(conn)
        conn.close()

    def read(conn: socket.socket) -> None:
        hello = unread[conn][0]
        try:
            got = conn.recv(_HELLO.size - len(hello))
        except BlockingIOError:
            return
        except OSError:
            got = b""
        hello += got
        if not got:
            drop(conn)
        elif len(hello) == _HELLO.size:
            keep(conn, _check_hello(hello, expected, token))

    def keep(conn: socket.socket, lane: _Lane | None) -> None:
        del unread[conn]
        selector.unregister(conn)
        if lane is None or lane in peers:  # a stranger, a duplicate, another handshake's
            conn.close()
            return
        try:
            conn.sendall(_ACK)  # one byte: a fresh connection's buffer takes it at once
        except OSError:
            conn.close()
            return
        peers[lane] = conn

    try:
        while len(peers) < len(expected) * LANES:
            if poll is not None:
                poll()
            now = time.monotonic()
            if now >= deadline:
                missing = [r for r in sorted(expected) if sum(k[0] == r for k in peers) < LANES]
                raise TransferTimeoutError(
                    f"ranks {missing} never opened their tcp connections to {me} at "
                    f"{_address(listener, local=True)} within {timeout_s:g} s"
                )
            for conn in [c for c, (_, expiry) in unread.items() if expiry <= now]:
                drop(conn)
            for key, _ in selector.select(_POLL_S):
                if key.fileobj is not listener:
                    read(key.fileobj)  # type: ignore[arg-type]  # only sockets are registered
                    continue
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                if len(unread) >= _GREETERS:
                    drop(next(iter(unread)))
                conn.setblocking(False)
                unread[conn] = (bytearray(), time.monotonic() + HELLO_S)
                selector.register(conn, selectors.EVENT_READ)
                read(conn)  # its hello is usually there already
    except BaseException:
        for s in peers.values():
            s.close()
        raise
    finally:
        for conn in list(unread):
            drop(conn)
        selector.close()
    return peers


def _check_hello(hello: bytearray, ranks: frozenset[int], token: str) -> _Lane | None:
    magic, rank, lane, signature = _HELLO.unpack(hello)
    if magic != _HELLO_MAGIC or rank not in ranks or not 0 <= lane < LANES:
        return None
    signed = hmac.compare_digest(signature, _signature(token, rank, lane))
    return (int(rank), int(lane)) if signed else None


def connect(
    address: str,
    port: int,
    *,
    rank: int,
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> Stream:
    """A worker's end of a fan-out: every lane to the sender at ``address:port``."""
    return Stream(rank, connect_lanes(address, port, rank=rank, token=token,
                                      timeout_s=timeout_s, poll=poll), timeout_s)  # fmt: skip


def connect_lanes(
    address: str,
    port: int,
    *,
    rank: int,
    token: str,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
    peer: int = 0,
    name: str = "the sender",
) -> dict[_Lane, socket.socket]:
    deadline = time.monotonic() + timeout_s
    lanes: dict[_Lane, socket.socket] = {}
    try:
        for lane in range(LANES):
            if poll is not None:
                poll()
            lanes[(peer, lane)] = _open_lane(address, port, rank, lane, token, deadline, name)
    except BaseException:
        for sock in lanes.values():
            sock.close()
        raise
    return lanes


def _open_lane(
    address: str, port: int, rank: int, lane: int, token: str, deadline: float, name: str
) -> socket.socket:
    what = f"tcp connection {lane} of rank {rank} to {name} at {address}:{port}"
    try:
        sock = socket.create_connection(
            (address, port), timeout=max(0.05, deadline - time.monotonic())
        )
    except OSError as e:
        raise TransferError(f"cannot open the {what}: {e}") from e
    try:
        _bound(sock, max(0.05, deadline - time.monotonic()))
        sock.sendall(_HELLO.pack(_HELLO_MAGIC, rank, lane, _signature(token, rank, lane)))
        _recv_exact(sock, memoryview(bytearray(1)), deadline)
    except (OSError, TransferError) as e:
        sock.close()
        raise TransferError(f"{name} did not accept the {what}: {e}") from e
    return sock


class StreamWork(ThreadWork):
    """One message on this rank's streams; :class:`Stream` words its failures."""

    recv_from: str = ""
    send_to: str = ""
    untaken: dict[int, str]

    def _taken(self, peer: int) -> None:
        self.untaken.pop(peer, None)
        self._count(sends=1)

    def pending_detail(self) -> str:
        if self.error is not None:
            return self.error
        if self.recvs_left:
            return f"its bytes have not arrived from rank {self.recv_peer} ({self.recv_from})"
        peers = ", ".join(f"rank {p} at {at}" for p, at in sorted(self.untaken.items()))
        role = f" ({self.send_to})" if self.send_to else " (is it still running?)"
        return f"not yet taken by {peers}{role}"


#: For a writer: the work, the bytes (a list: a sender's whole message), the message's length
#: on its first piece (its prefix goes first) else -1, and whether it is the last piece.
_Piece = tuple[StreamWork, "memoryview | list[memoryview]", int, bool]


class Stream:
    """This rank's end of the streams: a writer thread per lane of each downstream peer, a
    reader per lane of its upstream one (a relay has both). A connection that failed fails
    every later message on it: a stream cut mid-message cannot be resynchronised."""

    def __init__(
        self,
        rank: int,
        lanes: dict[_Lane, socket.socket],
        timeout_s: float,
        *,
        up: int | None = -1,
        roles: tuple[str, str] = ("the sender", ""),
        crc: bool = False,
    ) -> None:
        """``up``: the peer read from (``None``: only send; default: rank 0 unless this is
        it). ``roles`` name the up- and downstream peers in errors. ``crc``: messages carry
        the sender's CRC-32, checked behind a relay (straight from the sender, TCP's to check)."""
        self.rank = rank
        self.crc = crc
        self.timeout_s = timeout_s
        self.up: int | None = (None if rank == 0 else 0) if up == -1 else up
        self.verify = crc and self.up not in (None, 0)
        self.roles = roles
        self._lanes = lanes
        self._queues: dict[_Lane, queue.Queue[Any]] = {k: queue.Queue() for k in lanes}
        self._down = sorted({peer for peer, _ in lanes if peer != self.up})
        self._next = 0  # the next message's number: it travels on lane _next % LANES
        self._broken: dict[int, str] = {}  # per peer: one broken lane breaks them all
        self._cut: str | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._where: dict[_Lane, str] = {}
        for key, sock in lanes.items():
            _bound(sock, timeout_s)
            self._where[key] = _address(sock)
        for key in lanes:
            target = self._reader if key[0] == self.up else self._writer
            threading.Thread(
                target=target, args=(key,), name=f"wtcore-tcp-{rank}-{key}", daemon=True
            ).start()

    @property
    def checks_sizes(self) -> bool:
        """Always: a message's length prefix is read, and refused, before its bytes."""
        return True

    def set_abort(self, reason: str) -> None:
        """Nothing to tell: a release ends every receive, the control plane says why."""

    def abort_reason(self) -> str | None:
        return None

    def release(self, pending: Iterable[Work] = ()) -> None:
        self.close()

    def broadcast(self, tensor: torch.Tensor) -> StreamWork:
        return self.broadcast_parts([tensor])

    def broadcast_parts(self, tensors: Sequence[torch.Tensor]) -> StreamWork:
        """One message of ``tensors``' bytes in order (the packed buffer's wire bytes), sent
        from or received into them: neither end copies a packed bucket."""
        views = [_bytes_view(t) for t in tensors]
        nbytes = sum(len(v) for v in views)
        sender = self.up is None
        work = StreamWork(
            f"a message of {nbytes} bytes",
            recvs_left=0 if sender else 1,
            sends_left=len(self._down),
            recv_peer=self.up,
            send_peer=self._down[0] if len(self._down) == 1 else None,
        )
        work.recv_from, work.send_to = self.roles
        with self._lock:
            if self._closed.is_set():
                raise TransferError("the tcp streams were closed")
            lane, self._next = self._next % LANES, self._next + 1
            work.untaken = {peer: self._where[(peer, lane)] for peer in self._down}
            if sender:
                for peer in self._down:
                    self._queues[(peer, lane)].put((work, views, nbytes, True))
            else:
                self._queues[(self.up, lane)].put((work, views, nbytes))  # type: ignore[index]
        return work

    def _fail(self, key: _Lane, work: StreamWork, error: BaseException) -> None:
        peer = key[0]
        with self._lock:
            self._broken.setdefault(peer, str(error))
        where = self._where[key]
        if peer == self.up:
            work._fail(
                f"receiving {work.label} from rank {peer} ({self.roles[0]}) at {where} "
                f"failed: {error}"
            )
        else:
            role = f" ({self.roles[1]})" if self.roles[1] else ""
            work._fail(
                f"sending {work.label} to rank {peer}{role} at {where} failed: {error}",
                receiving=True,
            )

    def _break_down(self, why: str) -> None:
        """Cut a relay's onward connections: the receivers behind fail now, not at timeout."""
        with self._lock:
            if self._cut is None:
                self._cut = why
            for peer in self._down:
                self._broken.setdefault(peer, why)
        for (peer, _), sock in self._lanes.items():
            if peer != self.up:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _jobs(self, key: _Lane) -> Any:
        """This lane's messages; once its peer broke (or the stream closed), each one fails."""
        q = self._queues[key]
        while (job := q.get()) is not None:
            broken = self._broken.get(key[0])
            if broken is None and self._closed.is_set():
                broken = "the tcp streams were closed"
            if broken is not None:
                # A later piece of a message: its first piece failed it, or went out before
                # the break; its last piece fails it then, or its send would never end.
                if key[0] != self.up and job[2] < 0 and not job[3]:
                    continue
                self._fail(key, job[0], TransferError(f"the connection failed earlier: {broken}"))
                continue
            yield job
            del job

    def _writer(self, key: _Lane) -> None:
        with self._lanes[key] as sock:
            self._write(key, sock)

    def _write(self, key: _Lane, sock: socket.socket) -> None:
        piece: _Piece
        for piece in self._jobs(key):
            work, view, total, last = piece
            try:
                if isinstance(view, list):  # a sender's whole message, from its tensors
                    trailer = _TRAILER.pack(_crc(view)) if self.crc else b""
                    _send_gathered(sock, view, total, trailer)
                elif total >= 0:
                    _send_message(sock, view, total)
                else:
                    sock.sendall(view)
            except OSError as e:
                if self._cut is not None:  # this relay cut it: say why, not "Broken pipe"
                    self._fail(key, work, TransferError(f"cut by this relay: {self._cut}"))
                    continue
                why = "timed out" if isinstance(e, BlockingIOError) else str(e)
                peer = "the worker" if not self.roles[1] else f"rank {key[0]}"
                self._fail(key, work, TransferError(f"{why} (is {peer} still running?)"))
                continue
            if last:
                work._taken(key[0])

    def _reader(self, key: _Lane) -> None:
        with self._lanes[key] as sock:
            self._read(key, sock)

    def _read(self, key: _Lane, sock: socket.socket) -> None:
        head = bytearray(_PREFIX.size)
        onward = [self._queues[(peer, key[1])] for peer in self._down]
        for work, views, planned in self._jobs(key):
            deadline = time.monotonic() + self.timeout_s
            try:
                _recv_exact(sock, memoryview(head), deadline)
                magic, nbytes = _PREFIX.unpack(head)
                if magic != _MAGIC:
                    raise TransferError(f"a malformed message prefix (magic {magic:#x})")
                if nbytes != planned:
                    raise TransferError(
                        f"{self.roles[0]} (rank {key[0]}) sent {nbytes} bytes where this "
                        f"receiver planned "
                        f"{planned}; refused before reading any of them"
                    )
                if onward:
                    self._relay(key[1], sock, work, views, planned, deadline)
                else:
                    _recv_scattered(sock, views, deadline)
                    if self.crc:
                        self._check_crc(sock, _crc(views) if self.verify else None, deadline)
            except (OSError, TransferError) as e:
                if isinstance(e, TransferTimeoutError):
                    e = TransferTimeoutError(f"timed out after {self.timeout_s:g} s ({e})")
                if onward:
                    self._break_down(f"rank {self.rank} could not hand on {work.label}: {e}")
                self._fail(key, work, e)
                continue
            work._count(recvs=1)

    def _relay(
        self,
        lane: int,
        sock: socket.socket,
        work: StreamWork,
        views: list[memoryview],
        total: int,
        deadline: float,
    ) -> None:
        """Read a message into ``views``, handing each piece on as it lands; with ``crc``,
        then the sender's CRC-32, once checked (the last piece)."""
        pieces = [v[at : at + RELAY_CHUNK] for v in views for at in range(0, len(v), RELAY_CHUNK)]
        crc, last = 0, len(pieces) - 1 if not self.crc else -1
        for i, piece in enumerate(pieces):
            _recv_exact(sock, piece, deadline)
            crc = zlib.crc32(piece, crc) if self.verify else 0
            self._hand_on(lane, (work, piece, total if i == 0 else -1, i == last))
        if not pieces:  # an empty message is handed on too
            self._hand_on(lane, (work, memoryview(b""), 0, not self.crc))
        if self.crc:
            checked = crc if self.verify else None
            self._hand_on(lane, (work, self._check_crc(sock, checked, deadline), -1, True))

    def _check_crc(self, sock: socket.socket, crc: int | None, deadline: float) -> memoryview:
        """Read the sender's CRC-32 and refuse the message unless ``crc`` (``None``: not
        checked here) matches it; the trailer, to hand on."""
        trailer = memoryview(bytearray(_TRAILER.size))
        _recv_exact(sock, trailer, deadline)
        (want,) = _TRAILER.unpack(trailer)
        if crc is not None and crc != want:
            raise TransferError(
                f"its CRC-32 is {crc:08x} where the trainer's is {want:08x}: bytes changed on "
                "the way; refused"
            )
        return trailer

    def _hand_on(self, lane: int, piece: _Piece) -> None:
        """Queue ``piece`` for every downstream writer of ``lane``; once closed, fail its
        message instead (no writer would take it, and it would hold up the next round)."""
        with self._lock:
            if not self._closed.is_set():
                for peer in self._down:
                    self._queues[(peer, lane)].put(piece)
                return
        for peer in self._down:
            self._fail((peer, lane), piece[0], TransferError("the tcp streams were closed"))

    def close(self) -> None:
        """Shut every connection down: calls in progress end, later messages fail. Each
        thread closes its own socket (closing here could reuse a descriptor still in use)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            for q in self._queues.values():
                q.put(None)
        for sock in self._lanes.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
