"""Strict request framing: where a body starts and ends, read one way only.

Two parsers that disagree about a request's length are how requests get smuggled and how a
small request reserves a large buffer: a server whose size check reads one ``Content-Length``
while its body reader reads another can be made to allocate what the check refused. So the
framing is decided once, here, and refuses anything with two readings:

* at most one ``Content-Length``, plain ASCII digits only (``1_0``, ``+5``, `` 5 `` and ``0x5``
  are refused, not read as numbers);
* no ``Transfer-Encoding`` at all (the receiver takes no chunked bodies);
* at most one ``Authorization`` (which one would win is exactly the ambiguity to avoid);
* header names are RFC 9110 tokens and values hold no line breaks (no obsolete line folding).

Used by :mod:`wtcore_http_client.server` on every request and by
:meth:`~wtcore_http_client.routes.ReceiverRoutes.precheck` for a ``Content-Length`` it is
given by another framework.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["FramingError", "check_headers", "parse_content_length"]

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_DIGITS = re.compile(r"[0-9]{1,18}")  # 18 digits: far beyond any body limit, and no bigints
_SINGLE = ("content-length", "authorization", "host")


class FramingError(ValueError):
    """A request whose framing or headers are ambiguous: answered, then the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_content_length(raw: str) -> int:
    """The value of one ``Content-Length`` header: ASCII digits only, else a 400."""
    if not _DIGITS.fullmatch(raw):
        raise FramingError(400, f"Content-Length: expected 1 to 18 ASCII digits, got {raw[:40]!r}")
    return int(raw)


def check_headers(items: Iterable[tuple[str, str]]) -> int:
    """Check every header of a request; return its body length (0 when none is declared)."""
    seen: dict[str, str] = {}
    for name, value in items:
        if not _TOKEN.fullmatch(name):
            raise FramingError(400, f"header name {name[:40]!r}: not a valid token")
        if "\r" in value or "\n" in value:
            raise FramingError(400, f"header {name}: line folding or a line break in the value")
        key = name.lower()
        if key in seen and key in _SINGLE:
            raise FramingError(400, f"header {name}: sent more than once")
        seen[key] = value
    if "transfer-encoding" in seen:
        if "content-length" in seen:
            raise FramingError(400, "both Transfer-Encoding and Content-Length: ambiguous length")
        raise FramingError(411, "Transfer-Encoding is not accepted; send a Content-Length")
    raw = seen.get("content-length")
    return 0 if raw is None else parse_content_length(raw)
