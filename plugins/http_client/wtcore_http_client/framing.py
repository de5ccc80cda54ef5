"""Strict request framing: where a body starts and ends, read one way only.

Two parsers that disagree about a request's length are how requests get smuggled and how a
small request reserves a large buffer, so anything with two readings is refused: more than one
``Content-Length`` (digits only), ``Authorization`` or ``Host``; any ``Transfer-Encoding``; header
names that are not RFC 9110 tokens; line breaks in values.
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
