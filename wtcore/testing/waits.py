"""Bounded polling for tests: wait for a condition another process or thread brings about."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    pred: Callable[[], object], timeout_s: float, what: str, *, poll_s: float = 0.05
) -> None:
    """Return once ``pred()`` is true; past ``timeout_s`` fail (an assertion) naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() <= deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)
