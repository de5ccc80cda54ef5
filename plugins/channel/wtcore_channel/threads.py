"""One thread per (trainer rank, receiver) pair, waited for together (sharded rounds): no
pair waits for another, and the first failure ends them all, not their timeouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wtcore_kit.concurrency import BackgroundCall

__all__ = ["run_all"]

_POLL_S = 0.05


def run_all(
    calls: list[BackgroundCall[Any]],
    cut: Callable[[], None],
    timeout_s: float,
    poll: Callable[[], None] | None,
) -> None:
    """Wait for every pair's thread; at the first failure ``cut`` the pairs (so the others
    end at once, each waited for at most ``timeout_s``) and raise it. ``poll`` runs between
    short waits (it raises to give up). ``cut`` runs once more at the end in every case."""
    try:
        for call in calls:
            while not call.wait(_POLL_S):
                if poll is not None:
                    poll()
                failed = next((c for c in calls if c.error is not None), None)
                if failed is not None:
                    failed.result(0)
            call.result(0)
    except BaseException:
        cut()
        for call in calls:  # every thread ends once its pair is cut (bounded)
            call.wait(timeout_s)
        raise
    finally:
        cut()
