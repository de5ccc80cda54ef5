"""The one default timeout: it bounds each blocking wait, never a whole round, and is generous
because a rendezvous waits for every receiver to come up."""

from __future__ import annotations

from wtcore.errors import PayloadError

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "check_timeout"]

DEFAULT_TIMEOUT_S = 300.0
#: Upper bound on any ``timeout_s`` (one day): more (or JSON's Infinity) overflows torch's.
MAX_TIMEOUT_S = 86400.0


def check_timeout(name: str, value: object) -> float:
    """``value`` as seconds if in (0, :data:`MAX_TIMEOUT_S`], else a ``PayloadError`` naming it."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not 0 < value <= MAX_TIMEOUT_S
    ):
        raise PayloadError(
            f"{name}: expected a positive number of seconds up to {MAX_TIMEOUT_S:g}, got {value!r}"
        )
    return float(value)
