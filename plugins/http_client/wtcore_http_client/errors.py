"""Errors of the HTTP control plane.

Each carries what :func:`wtcore_kit.fanout.failure_of` reads (``status``, ``timed_out``,
``record``), so a fanned-out call reports every failing URL as the other clients do.
"""

from __future__ import annotations

from wtcore.errors import (
    ErrorRecord,
    PayloadError,
    ReceiverTimeoutError,
    TransferError,
    WtcoreError,
)

__all__ = ["HTTPConnectionError", "HTTPStatusError", "ReceiverTimeoutError"]

_TIMEOUT_STATUSES = frozenset({408, 504})


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

    def __reduce__(self) -> tuple[type[HTTPStatusError], tuple[int, str, str, str | None]]:
        return (type(self), (self.status, self.route, self.message, self.server_error_type))

    @property
    def detail(self) -> str:
        """The message without the server's error class (a failure reports that separately)."""
        return f"{self.route}: {self.message}"

    @property
    def record(self) -> ErrorRecord:
        """The server's error as a record (500 for a status outside 400-599)."""
        status = self.status if 400 <= self.status <= 599 else 500
        try:
            return ErrorRecord(self.server_error_type or "HTTPStatusError", self.detail, status)
        except PayloadError:  # a class name no record may carry: keep it in the message
            return ErrorRecord("HTTPStatusError", str(self), status)

    @property
    def timed_out(self) -> bool:
        return self.status in _TIMEOUT_STATUSES


class HTTPConnectionError(TransferError):
    """A receiver could not be reached, or closed the connection without answering."""

    status: int | None = None
