"""Errors of the HTTP control plane.

Each one carries what :func:`wtcore.fanout.failure_of` reads (``status``), so that a fanned-out
call reports every failing URL with its HTTP status and the server's own message.
"""

from __future__ import annotations

from wtcore.errors import ReceiverError, TransferError, TransferTimeoutError, WtcoreError

__all__ = ["HTTPConnectionError", "HTTPStatusError", "ReceiverTimeoutError"]


class HTTPStatusError(WtcoreError, RuntimeError):
    """A receiver answered with an HTTP error status (4xx or 5xx)."""

    def __init__(
        self, status: int, route: str, message: str, server_error_type: str | None = None
    ) -> None:
        self.status = status
        self.route = route
        self.message = message
        self.server_error_type = server_error_type
        kind = f"{server_error_type}: " if server_error_type else ""
        super().__init__(f"{route}: {kind}{message}")


class HTTPConnectionError(TransferError):
    """A receiver could not be reached, or closed the connection without answering."""


class ReceiverTimeoutError(ReceiverError, TransferTimeoutError):
    """Every failing receiver of a fanned-out call failed by timing out.

    It is both a :class:`~wtcore.errors.ReceiverError` (each URL is named) and a
    ``TimeoutError``, so ``except TimeoutError`` catches a stuck replica.
    """
