"""Errors of the HTTP control plane.

Each one carries what :func:`wtcore.fanout.failure_of` reads (``status``,
``server_error_type``, ``timed_out``), so that a fanned-out call reports every failing URL with
its HTTP status, the server's own error class and message, and counts a receiver's timeout as
a timeout exactly as the in-process and Ray clients do.

``ReceiverTimeoutError`` is the core's :class:`wtcore.errors.ReceiverTimeoutError`, re-exported
here so the old import path keeps working.
"""

from __future__ import annotations

from wtcore.errors import ReceiverTimeoutError, TransferError, WtcoreError

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
    def timed_out(self) -> bool:
        """Whether the receiver answered that a wait of its own ran out (408 or 504)."""
        return self.status in _TIMEOUT_STATUSES


class HTTPConnectionError(TransferError):
    """A receiver could not be reached, or closed the connection without answering."""

    #: No HTTP answer came back, so there is no status to report.
    status: int | None = None
