"""The reference receiver server: a :class:`wtcore.WeightSyncWorker` over HTTP.

Why the standard library's :class:`~http.server.ThreadingHTTPServer` and not uvicorn:

* no new dependency: the plugin needs only ``requests`` (for the client);
* one thread per connection is exactly the concurrency the protocol needs: an
  ``update_weights`` that blocks in a broadcast keeps its thread, while ``/health`` and
  ``/weight_info`` are answered on others. An ASGI server would have to push every blocking
  worker call into a thread pool anyway;
* control messages are tiny, and bulk bodies (the ``local`` engine's base64 buckets) are read
  with ``readinto`` into one buffer (see docs/benchmarks.md).

The request rules live in :class:`~wtcore_http_client.routes.ReceiverRoutes`; this module only
moves bytes; :mod:`wtcore_http_client.commands` builds the worker and the model around it.
Run it as ``wtcore serve`` or ``python -m wtcore_http_client.server``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from wtcore_http_client.routes import ReceiverRoutes, Response

__all__ = ["ReceiverHTTPServer", "check_bind", "is_loopback"]

log = logging.getLogger("wtcore_http_client.server")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, has_api_key: bool) -> None:
    """Refuse to expose an unauthenticated receiver beyond this machine."""
    if not is_loopback(host) and not has_api_key:
        raise ValueError(
            f"refusing to bind {host!r} without an API key: anyone who can reach it could "
            "replace the model's weights. Pass --api-key (or WTCORE_API_KEY), or bind 127.0.0.1"
        )


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, so the client's session reuses connections
    server_version = "wtcore-http"

    # Headers and body go out in two writes; with Nagle on, the second waits for the client's
    # delayed ACK, which made every control call tens of milliseconds (docs/benchmarks.md).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    # Standard methods no route accepts: a JSON 405 (or 404), not the stdlib's HTML 501.
    def do_PATCH(self) -> None:
        self._serve()

    def do_OPTIONS(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self.close_connection = True  # a HEAD answer has no body; start afresh after it
        self._serve()

    def _serve(self) -> None:
        routes = self.server.routes
        headers = dict(self.headers.items())
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            self._send(
                Response(
                    411,
                    {
                        "error": "send a Content-Length, not a chunked body",
                        "error_type": "LengthRequired",
                        "status": 411,
                    },
                )
            )
            return
        early = routes.precheck(self.command, self.path, headers)
        if early is not None:
            # The body was not read: close the connection rather than parse what follows.
            self.close_connection = True
            self._send(early)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = bytearray(length)
        view = memoryview(body)
        got = 0
        while got < length:
            n = self.rfile.readinto(view[got:])
            if not n:
                self.close_connection = True
                return  # the client went away mid-body: nothing to answer, nothing applied
            got += n
        self._send(routes.handle(self.command, self.path, headers, body))

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler stuck on a dead peer never blocks the exit
    allow_reuse_address = True
    routes: ReceiverRoutes

    def __init__(self, addr: tuple[str, int], routes: ReceiverRoutes, family: int) -> None:
        self.address_family = family
        self.routes = routes
        super().__init__(addr, _Handler)


class ReceiverHTTPServer:
    """Serves :class:`ReceiverRoutes` on ``host:port`` from a background thread.

    ``port=0`` picks a free port; :attr:`url` tells which. A non-loopback ``host`` needs the
    routes to have an API key (:func:`check_bind`).
    """

    def __init__(self, routes: ReceiverRoutes, *, host: str = "127.0.0.1", port: int = 0) -> None:
        check_bind(host, routes.requires_auth)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.routes = routes
        self._server = _Server((host, port), routes, family)
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
        """Stop accepting requests and close the socket (running handlers are daemons)."""
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
    # ``python -m wtcore_http_client.server``: this file runs as ``__main__``, a module of its
    # own, so handing over to the command module imports nothing back into this one.
    from wtcore_http_client.commands import main

    sys.exit(main())
