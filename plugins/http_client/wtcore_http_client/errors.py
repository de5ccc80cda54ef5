"""Errors of the HTTP control plane.

Each one carries what :func:`wtcore_kit.fanout.failure_of` reads (``status``, ``timed_out``, and
for an error answer the server's :class:`~wtcore.errors.ErrorRecord` as ``record``), so that a
fanned-out call reports every failing URL with its HTTP status, the server's own error class
and message, and counts a receiver's timeout as a timeout exactly as the in-process and Ray
clients do.

``ReceiverTimeoutError`` is the core's :class:`wtcore.errors.ReceiverTimeoutError`, re-exported
here so the old import path keeps working.
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

#: Statuses that mean "the receiver (or a proxy) ran out of time".
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
        """The server's error as a record: its class (``HTTPStatusError`` when it named none),
        :attr:`detail`, and the status (500 for one outside 400-599)."""
        status = self.status if 400 <= self.status <= 599 else 500
        try:
            return ErrorRecord(self.server_error_type or "HTTPStatusError", self.detail, status)
        except PayloadError:  # a class name no record may carry: keep it in the message
            return ErrorRecord("HTTPStatusError", str(self), status)

    @property
    def timed_out(self) -> bool:
        """Whether the receiver answered that a wait of its own ran out (408 or 504)."""
        return self.status in _TIMEOUT_STATUSES


class HTTPConnectionError(TransferError):
    """A receiver could not be reached, or closed the connection without answering."""

    #: No HTTP answer came back, so there is no status to report.
    status: int | None = None
