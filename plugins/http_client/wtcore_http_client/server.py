"""The reference receiver server: :class:`ReceiverRoutes` on the stdlib's threading server.

This module only moves bytes, bounded against a hostile peer (:class:`ServerLimits`): bodies are
read as they arrive, never allocated from a header, and one reaper thread shuts a connection
whose phase runs late (a per-read timeout alone lets a peer trickle a byte per timeout).
See docs/http.md, "Limits" and "Why the standard library's threading server".
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from wtcore.errors import ErrorRecord, PayloadError
from wtcore_http_client.framing import FramingError, check_headers
from wtcore_http_client.routes import ReceiverRoutes, Response

__all__ = ["ReceiverHTTPServer", "ServerLimits", "check_bind", "is_loopback"]

log = logging.getLogger("wtcore_http_client.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, has_api_key: bool) -> None:
    """Refuse to expose an unauthenticated receiver beyond this machine."""
    if not is_loopback(host) and not has_api_key:
        raise PayloadError(
            f"refusing to bind {host!r} without an API key: anyone who can reach it could "
            "replace the model's weights. Pass --api-key (or WTCORE_API_KEY), or bind 127.0.0.1"
        )


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may hold of the server (``wtcore serve`` options of the same names;
    docs/http.md, "Limits")."""

    max_connections: int = 64
    idle_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0
    max_header_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PayloadError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise PayloadError(f"{name}: expected a positive number, got {value!r}")


class _HeaderReader:
    """The handler's ``rfile`` while the request line and headers are read: counts their bytes."""

    def __init__(self, inner: io.BufferedReader, limit: int) -> None:
        self.inner = inner
        self.left = limit

    def readline(self, size: int = -1) -> bytes:
        cap = self.left + 1 if size < 0 else min(size, self.left + 1)
        line = self.inner.readline(cap)
        self.left -= len(line)
        if self.left < 0:
            # parse_request answers LineTooLong with a 431 and closes the connection.
            raise http.client.LineTooLong("request line and headers")
        return line


_CHUNK = 1 << 20  # body bytes read at once: memory follows what arrived, not what was declared


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, so the client's session reuses connections
    server_version = "wtcore-http"

    # Headers and body go out in two writes; with Nagle on, the second waits for the client's
    # delayed ACK, which made every control call tens of milliseconds (docs/benchmarks.md).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    def setup(self) -> None:
        super().setup()
        assert isinstance(self.rfile, io.BufferedReader)  # socketserver's buffered makefile
        self._body_file: io.BufferedReader = self.rfile

    def handle_one_request(self) -> None:
        limits = self.server.limits
        self.server.deadline(self.connection, limits.idle_timeout_s)
        try:
            if not self._body_file.peek(1):
                self.close_connection = True
                return
        except OSError:  # timed out, reset, or shut by the reaper
            self.close_connection = True
            return
        self.server.deadline(self.connection, limits.header_timeout_s)
        self.rfile = _HeaderReader(self._body_file, limits.max_header_bytes)  # type: ignore[assignment]
        try:
            super().handle_one_request()
        except OSError:
            self.close_connection = True
        finally:
            self.rfile = self._body_file
            self.server.deadline(self.connection, None)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own refusals (bad request line, 431, 501) as JSON, then close."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # an unparsable line: answer with a status line
            self.request_version = "HTTP/1.1"
        text = message or self.responses.get(code, ("error",))[0]
        if explain:
            text = f"{text}: {explain}"
        self._send(Response(code, ErrorRecord("HTTPError", text, code).to_json()))

    def do_HEAD(self) -> None:
        self.close_connection = True  # a HEAD answer has no body; start afresh after it
        self._serve()

    def _serve(self) -> None:
        routes = self.server.routes
        self.rfile = self._body_file
        try:
            if self.headers.defects or self.headers.get_payload():
                # The stdlib's parser takes a malformed line (``Name : v``, no colon) as the
                # end of the headers and drops the rest: refuse rather than guess.
                raise FramingError(400, "a malformed header line (no colon, or space before it)")
            length = check_headers(self.headers.items())
        except FramingError as e:
            self.close_connection = True
            error_type = "LengthRequired" if e.status == 411 else "PayloadError"
            self._send(Response(e.status, ErrorRecord(error_type, e.message, e.status).to_json()))
            return
        headers = dict(self.headers.items())  # no duplicates left to choose between
        early = routes.precheck(self.command, self.path, headers)
        if early is not None:
            # The body was not read: close the connection rather than parse what follows.
            self.close_connection = True
            self._send(early)
            return
        self.server.deadline(self.connection, self.server.limits.body_timeout_s)
        body = bytearray()
        while len(body) < length:
            chunk = self.rfile.read1(min(_CHUNK, length - len(body)))
            if not chunk:
                self.close_connection = True
                return  # the client went away (or was too slow): nothing applied
            body += chunk
        self.server.deadline(self.connection, None)  # the call itself has the worker's timeouts
        response = routes.handle(self.command, self.path, headers, body)
        del body
        self.server.deadline(self.connection, self.server.limits.body_timeout_s)
        self._send(response)

    # Every method reaches the routes, which answer one no route accepts with a JSON 405 (or
    # 404), not the stdlib's HTML 501.
    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _serve

    def _send(self, response: Response) -> None:
        data = json.dumps(response.body).encode()
        self.send_response(response.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if response.status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler stuck on a dead peer never blocks the exit
    allow_reuse_address = True
    routes: ReceiverRoutes

    def __init__(
        self, addr: tuple[str, int], routes: ReceiverRoutes, family: int, limits: ServerLimits
    ) -> None:
        self.address_family = family
        self.routes = routes
        self.limits = limits
        self._lock = threading.Lock()
        self._active = 0
        self._deadlines: dict[socket.socket, float] = {}
        self._closed = threading.Event()
        super().__init__(addr, _Handler)
        self._reaper = threading.Thread(target=self._reap, name="wtcore-http-reaper", daemon=True)
        self._reaper.start()

    def deadline(self, conn: socket.socket, seconds: float | None) -> None:
        """Shut ``conn`` if its current phase has not ended ``seconds`` from now (None: never)."""
        with self._lock:
            if seconds is None:
                self._deadlines.pop(conn, None)
            else:
                self._deadlines[conn] = time.monotonic() + seconds
                conn.settimeout(seconds)  # a backstop should the reaper be late

    def _reap(self) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for c in late:
                    del self._deadlines[c]
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RDWR)  # the handler's read or write ends at once
                except OSError:
                    pass

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            busy = self._active >= self.limits.max_connections
            if not busy:
                self._active += 1
        if busy:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._lock:
                self._active -= 1
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._active -= 1
                self._deadlines.pop(request, None)

    def _refuse(self, request: socket.socket) -> None:
        message = f"too many connections (the limit is {self.limits.max_connections})"
        body = json.dumps(ErrorRecord("ServiceUnavailable", message, 503).to_json()).encode()
        try:
            request.settimeout(1.0)
            request.sendall(_BUSY % (len(body), body))
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()
        self._reaper.join(5.0)


class ReceiverHTTPServer:
    """Serves :class:`ReceiverRoutes` on ``host:port`` (0: a free one) from a background thread;
    a non-loopback ``host`` needs an API key."""

    def __init__(
        self,
        routes: ReceiverRoutes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
    ) -> None:
        check_bind(host, routes.requires_auth)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.routes = routes
        self.limits = limits or ServerLimits()
        self._server = _Server((host, port), routes, family, self.limits)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._server.server_address[0])
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> ReceiverHTTPServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="wtcore-http-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout_s)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> ReceiverHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    # The serve command lives in wtcore_http_client.commands, which imports this module, so it
    # is run by name, never imported back (tests/core/test_import_graph.py counts this block).
    import runpy

    runpy.run_module("wtcore_http_client.commands", run_name="__main__", alter_sys=True)
