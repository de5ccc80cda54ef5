"""Listening sockets of a sender (nccl's store, tcp's streams): on one address only, never on
every interface, with one wording for an address not of this host or a port taken."""

from __future__ import annotations

import errno
import socket

from wtcore.errors import TransferError

__all__ = ["listen_on"]


def listen_on(address: str, port: int, what: str, *, field: str = "master_") -> socket.socket:
    """A socket listening on ``address:port`` only (port 0: the kernel picks), for ``what``;
    ``field`` prefixes the config fields errors name (``master_address``)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM
        )[0]
    except OSError as e:
        raise TransferError(f"cannot resolve {field}address {address!r}: {e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise TransferError(
                f"cannot host {what} at {address}:{port}: the port is already in use (pick "
                f"another {field}port)"
            ) from e
        raise TransferError(
            f"cannot host {what} at {address}:{port}: {e} ({field}address must be an address "
            f"of this host: {what} listens there only)"
        ) from e
    return sock
