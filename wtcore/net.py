"""Loopback ports for rendezvous points that a tool sets up on this host (``wtcore bench``)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Another process can take it before the caller binds it; that race is acceptable for
    benchmarks and tests on one host, never for production rendezvous with fixed ports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
