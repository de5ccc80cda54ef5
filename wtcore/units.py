"""Human-readable sizes for command lines and configs (``64MiB``, ``1GiB``, ``4096``)."""

from __future__ import annotations

import re

from wtcore.errors import PayloadError

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS.update(kib=1 << 10, mib=1 << 20, gib=1 << 30)
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; raises :class:`~wtcore.errors.PayloadError` (a ``ValueError``) naming
    the accepted units."""
    if isinstance(text, int):
        return text
    m = _PATTERN.match(text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise PayloadError(
            f"expected a size such as 4096, 64MiB or 1GiB (units: B, KB, MB, GB, KiB, MiB, GiB), "
            f"got {text!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_size(n: int) -> str:
    """``1073741824`` -> ``1.0 GiB``."""
    value = float(n)
    if value < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} GiB"
