"""Waiting on the other side of a shared-memory ring: cheap, bounded, and aware of death.

With one control call per round, the trainer and the worker meet only in shared memory: the
worker waits for the trainer to stamp a slot's header, the trainer waits for every worker to
acknowledge the bucket a slot held before packing into it again. Both waits spin for a few
microseconds (a slot is often ready by then) and then sleep in growing steps of at most
:data:`MAX_SLEEP_S`, so an idle waiter costs next to no CPU on a machine whose cores the
copy itself needs. Every few milliseconds the waiter runs a ``check`` that raises when waiting
is pointless (the peer died, the round was aborted), and it gives up with a
:class:`~wtcore.errors.TransferTimeoutError` naming what it waited for after ``timeout_s``.

A bucket larger than a slot crosses the ring as slot-sized *chunks* (:func:`chunks`), the word
nccl's chain uses for a message cut in pieces; a *frame* is what a streamed engine sends per
bucket (``wtcore_channel.frames``).
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
    """``(start, length)`` of each chunk of a bucket of ``nbytes`` in slots of ``slot_bytes``.

    A bucket that fits a slot is one chunk; a bigger one (a single tensor larger than the
    bucket size, by the shared planning rule) is streamed through consecutive slots, so the
    ring never grows with the model's largest tensor. An empty bucket is one empty chunk.
    """
    if nbytes <= slot_bytes:
        return [(0, nbytes)]
    return [(s, min(slot_bytes, nbytes - s)) for s in range(0, nbytes, slot_bytes)]
