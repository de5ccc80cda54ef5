"""The streamed broadcast (``broadcast="stream"``): every message down TCP streams to each worker.

Gloo's broadcast is a rendezvous per message: the receiver posts its buffer, tells the sender,
and only then do the bytes move. A round of a few hundred tensors therefore pays a round trip
per tensor, and the frame header that must be checked before each receive is posted doubles
it; on a small host that framing alone capped a round at about 0.6x of one large broadcast
(docs/benchmarks.md). A byte stream has no rendezvous: the sender writes message after
message, the kernel's socket buffers keep the wire busy while the receiver checks a header,
and the receiver reads each message's length prefix before it reads a byte of the message,
so the size check is free and a sender whose sizes disagree cannot overrun a receive buffer.
The receiver refuses such a message (:class:`~wtcore.errors.TransferError`, naming both
sizes) instead of the transport aborting the process, as gloo does.

The sender (rank 0) listens on ``master_address`` (an address of its own host that every
worker reaches, as they reach the store there) on a port the kernel picks, and publishes the
port under the handshake's key prefix. Every worker opens :data:`LANES` connections and
introduces each with its rank, the lane's number and a token derived from the handshake's
secret; the sender drops a connection whose hello is malformed, late, a duplicate or wrongly
signed (a stranger who found the port), and acknowledges each lane it keeps, so both ends
leave :func:`connect` knowing the group is whole. Each message is a 16-byte prefix (magic,
byte count) and the bytes; message ``k`` of a handshake travels on lane ``k % LANES`` (both
ends number the messages in the same order), each lane from a thread of its own on both ends.
The sender writes every message to every worker (a fan-out: use the chain,
:mod:`wtcore_nccl.forward`, when the sender's link is the limit).

:meth:`Stream.broadcast` returns a :class:`StreamWork`, which behaves like the ``dist.Work``
of a collective for the callers (:func:`wtcore_nccl.pipeline.wait_work`, the reaper). Every
blocking socket call is bounded by the group's timeout (``SO_RCVTIMEO``/``SO_SNDTIMEO``), and
:meth:`Stream.close` shuts the sockets down, which ends any call in progress at once; a
receive never reports completion while its thread may still write into the buffer.
Only CPU tensors travel this way (the gloo transport).
"""

from __future__ import annotations

import hashlib
import hmac
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError, TransferTimeoutError
from wtcore_nccl.forward import ChainWork
from wtcore_nccl.sockets import listen_on

if TYPE_CHECKING:
    import torch

__all__ = ["LANES", "PORT_KEY", "Stream", "StreamWork", "connect"]

#: Store key (under the handshake's prefix) of the sender's stream port.
PORT_KEY = "stream/port"
_PREFIX = struct.Struct("<QQ")  # magic, byte count
_MAGIC = int.from_bytes(b"wtcstrm1", "big")
_HELLO = struct.Struct("<QQQ32s")  # magic, rank, lane, token
_HELLO_MAGIC = int.from_bytes(b"wtchelo1", "big")
_ACK = b"\x01"
#: How long an accepted connection may take to say hello before it is dropped.
_HELLO_S = 5.0
_POLL_S = 0.05
#: TCP connections per worker ("lanes"): message ``k`` travels on lane ``k % LANES``. On
#: loopback the sender's kernel does most of a connection's work (its copy and the receiving
#: side's protocol processing), so one connection is bound by one core; two let the sender's
#: work run on two (docs/benchmarks.md: 1.3-1.5x one connection on 2 cores).
LANES = 2
#: Messages up to this size are written with their prefix in one call.
_SMALL = 1 << 16


def _token(secret: str, generation: int, rank: int, lane: int) -> bytes:
    """What rank ``rank`` proves it got this handshake's init call with: its secret (or, for
    a sender without one, the guessable generation, as the store keys are then)."""
    key = secret or f"generation-{generation}"
    return hashlib.sha256(f"wtcore-stream:{key}:{rank}:{lane}".encode()).digest()


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes (CPU, contiguous) as a writable memoryview, without a copy."""
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise TransferError(
            "broadcast='stream' moves contiguous CPU tensors only (use the collective on CUDA)"
        )
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy is a buffer


def _bound(sock: socket.socket, timeout_s: float) -> None:
    """Bound every blocking call on ``sock`` by ``timeout_s`` in the kernel (one syscall per
    message: a Python-level timeout would split each receive into many)."""
    sec = max(0.001, timeout_s)
    tv = struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock``; :class:`TransferError` if the peer closed,
    :class:`TransferTimeoutError` past ``deadline`` (each call is bounded by the socket's own
    timeout)."""
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


def _send_message(sock: socket.socket, view: memoryview) -> None:
    """Write one message, prefix and bytes in one call where the kernel takes it all."""
    prefix = _PREFIX.pack(_MAGIC, len(view))
    if len(view) <= _SMALL:
        sock.sendall(prefix + view.tobytes())
        return
    sent = sock.sendmsg([prefix, view])
    if sent < len(prefix):
        sock.sendall(prefix[sent:])
        sent = len(prefix)
    sock.sendall(view[sent - len(prefix) :])


def _address(sock: socket.socket) -> str:
    """``host:port`` of ``sock``'s peer, for error messages."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "an unknown address"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


_Lane = tuple[int, int]  # (peer rank, lane)


def _accept(
    listener: socket.socket,
    *,
    world_size: int,
    secret: str,
    generation: int,
    deadline: float,
    poll: Callable[[], None] | None,
) -> dict[_Lane, socket.socket]:
    """Keep every lane of every worker rank whose hello is signed; drop the others."""
    peers: dict[_Lane, socket.socket] = {}
    try:
        while len(peers) < (world_size - 1) * LANES:
            if poll is not None:
                poll()
            if time.monotonic() >= deadline:
                missing = [r for r in range(1, world_size) if sum(k[0] == r for k in peers) < LANES]
                raise TransferTimeoutError(
                    f"ranks {missing} never opened their stream connections to the sender"
                )
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            lane = _greet(conn, world_size, secret, generation)
            if lane is None or lane in peers:
                conn.close()  # a stranger, a duplicate, or a worker of another handshake
                continue
            conn.sendall(_ACK)
            peers[lane] = conn
    except BaseException:
        for s in peers.values():
            s.close()
        raise
    return peers


def _greet(conn: socket.socket, world_size: int, secret: str, generation: int) -> _Lane | None:
    """The worker rank and lane ``conn`` proves it is (within a few seconds), or ``None``."""
    hello = bytearray(_HELLO.size)
    try:
        _bound(conn, _HELLO_S)
        _recv_exact(conn, memoryview(hello), time.monotonic() + _HELLO_S)
    except (OSError, TransferError):
        return None
    magic, rank, lane, token = _HELLO.unpack(hello)
    if magic != _HELLO_MAGIC or not 0 < rank < world_size or not 0 <= lane < LANES:
        return None
    signed = hmac.compare_digest(token, _token(secret, generation, rank, lane))
    return (int(rank), int(lane)) if signed else None


def connect(
    store: Any,
    *,
    rank: int,
    world_size: int,
    address: str,
    secret: str,
    generation: int,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
) -> Stream:
    """Open the group's streams: rank 0 accepts every worker, the others connect to it.

    Call only once every rank arrived in the store (:func:`wtcore_nccl.group.join_group`).
    """
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        with listen_on(address, 0, "the nccl stream port") as listener:
            listener.settimeout(_POLL_S)  # accept in short waits, polling between them
            store.set(PORT_KEY, str(listener.getsockname()[1]))
            peers = _accept(
                listener,
                world_size=world_size,
                secret=secret,
                generation=generation,
                deadline=deadline,
                poll=poll,
            )
        return Stream(rank, peers, timeout_s)
    while not store.check([PORT_KEY]):
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            raise TransferTimeoutError(
                f"the sender at {address} published no stream port within {timeout_s:g} s"
            )
        time.sleep(0.01)
    try:
        port = int(bytes(store.get(PORT_KEY)))
    except ValueError as e:
        raise TransferError(f"the sender at {address} published a malformed port: {e}") from e
    lanes: dict[_Lane, socket.socket] = {}
    try:
        for lane in range(LANES):
            lanes[(0, lane)] = _open_lane(address, port, rank, lane, secret, generation, deadline)
    except BaseException:
        for sock in lanes.values():
            sock.close()
        raise
    return Stream(rank, lanes, timeout_s)


def _open_lane(
    address: str, port: int, rank: int, lane: int, secret: str, generation: int, deadline: float
) -> socket.socket:
    """Connect one lane to the sender, say hello, and wait for its acknowledgement."""
    what = f"stream connection {lane} of rank {rank} to the sender at {address}:{port}"
    try:
        sock = socket.create_connection(
            (address, port), timeout=max(0.05, deadline - time.monotonic())
        )
    except OSError as e:
        raise TransferError(f"cannot open the {what}: {e}") from e
    try:
        _bound(sock, max(0.05, deadline - time.monotonic()))
        sock.sendall(_HELLO.pack(_HELLO_MAGIC, rank, lane, _token(secret, generation, rank, lane)))
        _recv_exact(sock, memoryview(bytearray(1)), deadline)
    except (OSError, TransferError) as e:
        sock.close()
        raise TransferError(f"the sender did not accept the {what}: {e}") from e
    return sock


class StreamWork(ChainWork):
    """One message on this rank's streams; quacks like a ``dist.Work`` (see ChainWork).

    Its failures are worded by :class:`Stream`, which knows each peer's address.
    """

    def pending_detail(self) -> str:
        if self.error is not None:
            return self.error
        if self.recvs_left:
            return f"its bytes have not arrived from rank {self.recv_peer} (the sender)"
        return f"{self.sends_left} worker(s) have not yet taken it"


_Job = tuple[StreamWork, memoryview]


class Stream:
    """This rank's end of the streamed broadcast (see the module docstring).

    The sender has a connection and a writer thread per worker; a worker has one connection
    and a reader thread, which fills the posted receives in order. A connection that failed
    fails every later message on it: a stream cut mid-message cannot be resynchronised.
    """

    def __init__(self, rank: int, lanes: dict[_Lane, socket.socket], timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._lanes = lanes
        self._queues: dict[_Lane, queue.Queue[_Job | None]] = {k: queue.Queue() for k in lanes}
        self._num_peers = len({peer for peer, _ in lanes})
        self._next = 0  # the next message's number: it travels on lane _next % LANES
        self._broken: dict[int, str] = {}  # per peer: one broken lane breaks them all
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._where: dict[_Lane, str] = {}
        for key, sock in lanes.items():
            _bound(sock, timeout_s)
            self._where[key] = _address(sock)
        target = self._writer if rank == 0 else self._reader
        for key in lanes:
            threading.Thread(
                target=target, args=(key,), name=f"wtcore-nccl-stream-{rank}-{key}", daemon=True
            ).start()

    def broadcast(self, tensor: torch.Tensor) -> StreamWork:
        """Start sending ``tensor`` to every worker (rank 0) or receiving it (the others)."""
        view = _bytes_view(tensor)
        sender = self.rank == 0
        work = StreamWork(
            f"a message of {len(view)} bytes",
            recvs_left=0 if sender else 1,
            sends_left=self._num_peers if sender else 0,
            recv_peer=None if sender else 0,
        )
        with self._lock:
            if self._closed.is_set():
                raise TransferError("the nccl transfer group was closed")
            lane, self._next = self._next % LANES, self._next + 1
            for (_, n), q in self._queues.items():
                if n == lane:
                    q.put((work, view))
        return work

    def _fail(self, key: _Lane, work: StreamWork, error: BaseException) -> None:
        peer = key[0]
        with self._lock:
            self._broken.setdefault(peer, str(error))
        where = self._where[key]
        if self.rank == 0:
            work._fail(f"sending {work.label} to rank {peer} at {where} failed: {error}")
        else:
            work._fail(
                f"receiving {work.label} from rank 0 (the sender) at {where} failed: {error}"
            )

    def _jobs(self, key: _Lane) -> Any:
        """This lane's messages in order; once a lane of its peer broke (or the stream was
        closed), each one fails."""
        q = self._queues[key]
        while (job := q.get()) is not None:
            broken = self._broken.get(key[0])
            if broken is None and self._closed.is_set():
                broken = "the nccl transfer group was closed"
            if broken is not None:
                self._fail(key, job[0], TransferError(f"the connection failed earlier: {broken}"))
                continue
            yield job
            del job

    def _writer(self, key: _Lane) -> None:
        with self._lanes[key] as sock:
            self._write(key, sock)

    def _write(self, key: _Lane, sock: socket.socket) -> None:
        for work, view in self._jobs(key):
            try:
                _send_message(sock, view)
            except OSError as e:
                why = "timed out" if isinstance(e, BlockingIOError) else str(e)
                self._fail(key, work, TransferError(f"{why} (is the worker still running?)"))
                continue
            work._count(sends=1)

    def _reader(self, key: _Lane) -> None:
        with self._lanes[key] as sock:
            self._read(key, sock)

    def _read(self, key: _Lane, sock: socket.socket) -> None:
        head = bytearray(_PREFIX.size)
        for work, view in self._jobs(key):
            deadline = time.monotonic() + self.timeout_s
            try:
                _recv_exact(sock, memoryview(head), deadline)
                magic, nbytes = _PREFIX.unpack(head)
                if magic != _MAGIC:
                    raise TransferError(f"a malformed message prefix (magic {magic:#x})")
                if nbytes != len(view):
                    raise TransferError(
                        f"the sender sent {nbytes} bytes where this receiver planned "
                        f"{len(view)}; refused before reading any of them"
                    )
                _recv_exact(sock, view, deadline)
            except TransferTimeoutError as e:
                self._fail(
                    key, work, TransferTimeoutError(f"timed out after {self.timeout_s:g} s ({e})")
                )
                continue
            except (OSError, TransferError) as e:
                self._fail(key, work, e)
                continue
            work._count(recvs=1)

    def close(self) -> None:
        """Shut every connection down: calls in progress end, later messages fail (not joined).

        Each connection's thread closes its socket once it has let go of it (closing it here
        could hand its descriptor to a new socket while a call still uses it).
        """
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
