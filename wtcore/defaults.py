"""The one default timeout every engine and client shares.

One number, so that ``timeout_s`` means the same thing whichever engine or transport a user
picks: it bounds each blocking wait (a rendezvous, one bucket on the wire, one control call),
never a whole round. It is generous because a rendezvous waits for every receiver to come up;
a dead peer still costs at most this long, and fan-out clients fail fast once one receiver
has failed (see :mod:`wtcore_kit.fanout`).
"""

from __future__ import annotations

from wtcore.errors import PayloadError

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "check_timeout"]

#: Default bound on every blocking wait, in seconds.
DEFAULT_TIMEOUT_S = 300.0
#: Upper bound on any ``timeout_s``: one day. Larger values (or Infinity, which JSON decoders
#: accept) overflow torch's timeouts, and "wait forever" is what a timeout exists to avoid.
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
