"""The trainer-side client against hostile and flaky receivers (issue 14, items 5 and 12).

The receivers here are hand-written HTTP servers on real sockets, each doing one bad thing
on purpose: a 256 MiB error body, or a keep-alive connection closed after a 500.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from wtcore import ReceiverError
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_http_client.client import MAX_ERROR_BYTES

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

MIB = 1 << 20
Handler = Callable[[socket.socket, int], None]


def _read_request(conn: socket.socket) -> str | None:
    """The request line of the next request (headers read; none of these sends a body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    return head.split("\r\n", 1)[0]


def _answer(conn: socket.socket, status: str, body: bytes, close: bool = False) -> None:
    conn.sendall(
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}"
        "\r\n".encode()
        + body
    )


@pytest.fixture()
def serve() -> Iterator[Callable[[Handler], str]]:
    """``serve(handler)`` runs ``handler(conn, n)`` for the n-th connection; returns the URL."""
    listeners: list[socket.socket] = []

    def start(handler: Handler) -> str:
        lsock = socket.create_server(("127.0.0.1", 0))
        listeners.append(lsock)

        def accept() -> None:
            n = 0
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                threading.Thread(target=_run, args=(conn, n), daemon=True).start()
                n += 1

        def _run(conn: socket.socket, n: int) -> None:
            with conn:
                try:
                    handler(conn, n)
                except OSError:
                    pass

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{lsock.getsockname()[1]}"

    yield start
    for lsock in listeners:
        lsock.close()


def test_a_huge_error_body_is_not_read(serve: Callable[[Handler], str]) -> None:
    sent = [0]

    def hostile(conn: socket.socket, _n: int) -> None:
        if _read_request(conn) is None:
            return
        declared = 256 * MIB
        conn.sendall(
            f"HTTP/1.1 500 Internal Server Error\r\nContent-Length: {declared}\r\n\r\n".encode()
        )
        chunk = b'{"error": "' + b"x" * (MIB - 11)
        while sent[0] < declared:
            conn.sendall(chunk)
            sent[0] += len(chunk)

    url = serve(hostile)
    client = HTTPWeightSyncClient(url, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(ReceiverError) as err:
        client.health()
    (failure,) = err.value.failures
    assert failure.status == 500 and f"cut at {MAX_ERROR_BYTES} bytes" in failure.message
    assert len(failure.message) < 2000
    time.sleep(0.5)  # the server notices the closed connection
    # Read up to the cap, then the connection is dropped: the rest is never sent.
    assert sent[0] < 32 * MIB, f"the client read {sent[0]} bytes of an error body"
    assert time.monotonic() - start < 30
    client.close()


def _stale_after_error(seen: Counter[str], fail_route: str, message: bytes) -> Handler:
    """vLLM after a 500: the first ``fail_route`` gets a 500 on a keep-alive connection that
    the server then treats as closed: the next request on it is read and reset, unanswered.
    Every other request gets a 200. ``seen`` counts routes, and ``stale <route>`` for the one
    that met the dead connection."""
    failed = threading.Event()

    def handler(conn: socket.socket, _n: int) -> None:
        while (line := _read_request(conn)) is not None:
            route = line.split()[1].split("?")[0]
            seen[route] += 1
            if route == fail_route and not failed.is_set():
                failed.set()
                _answer(conn, "500 Internal Server Error", b'{"error": "' + message + b'"}')
                stale = _read_request(conn)
                seen[f"stale {stale and stale.split()[1].split('?')[0]}"] += 1
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                return
            _answer(conn, "200 OK", b'{"status": "ok"}')

    return handler


def test_idempotent_calls_retry_once_on_a_connection_closed_after_an_error(
    serve: Callable[[Handler], str],
) -> None:
    seen: Counter[str] = Counter()
    url = serve(_stale_after_error(seen, "/pause", b"engine crashed"))
    client = HTTPWeightSyncClient(url, timeout_s=30)
    with pytest.raises(ReceiverError, match="engine crashed"):
        client.pause()
    client.resume()  # the stale socket: refused once, then sent again on a fresh connection
    assert seen["stale /resume"] == 1 and seen["/resume"] == 1
    assert client.health() == [{"status": "ok"}]
    client.close()


def test_protocol_calls_are_never_retried(serve: Callable[[Handler], str]) -> None:
    seen: Counter[str] = Counter()
    url = serve(_stale_after_error(seen, "/health", b"boom"))
    client = HTTPWeightSyncClient(url, timeout_s=30)
    with pytest.raises(ReceiverError, match="boom"):
        client.health()
    with pytest.raises(ReceiverError, match="HTTPConnectionError"):
        client.start_weight_update()
    # sent once, on the stale connection, and never again on a fresh one
    assert seen["stale /start_weight_update"] == 1 and seen["/start_weight_update"] == 0
    client.close()
