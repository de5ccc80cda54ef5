"""Waiting on the other side of a shared-memory ring: cheap, bounded, and aware of death.

Waits spin briefly, then sleep in growing steps (an idle waiter leaves the cores to the
copy), and every :data:`CHECK_EVERY_S` run a ``check`` that raises when waiting is pointless
(docs/ipc.md). A bucket larger than a slot crosses the ring as slot-sized *chunks*.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from wtcore.errors import TransferTimeoutError

__all__ = ["CHECK_EVERY_S", "MAX_SLEEP_S", "chunks", "wait_until"]

#: Longest single sleep of a waiter: bounds the latency a slow wake-up adds per bucket.
MAX_SLEEP_S = 0.001
#: How often a waiter runs its (costlier) ``check``: the peer's liveness, an abort flag.
CHECK_EVERY_S = 0.02
_SPINS = 64
_FIRST_SLEEP_S = 20e-6


def wait_until(
    ready: Callable[[], bool], *, timeout_s: float, check: Callable[[], None], what: str
) -> None:
    """Return once ``ready()`` is true; ``check()`` raises to give up; time out after
    ``timeout_s`` seconds with an error saying ``what`` never happened."""
    for _ in range(_SPINS):
        if ready():
            return
    start = time.monotonic()
    deadline = start + timeout_s
    next_check = start
    sleep_s = _FIRST_SLEEP_S
    while True:
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + CHECK_EVERY_S
        if ready():
            return
        if now >= deadline:
            raise TransferTimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, MAX_SLEEP_S)


def chunks(nbytes: int, slot_bytes: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of a bucket of ``nbytes`` in slots of ``slot_bytes``
    (an empty bucket is one empty chunk)."""
    if nbytes <= slot_bytes:
        return [(0, nbytes)]
    return [(s, min(slot_bytes, nbytes - s)) for s in range(0, nbytes, slot_bytes)]
