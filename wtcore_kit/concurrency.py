"""Run a blocking call on a helper thread and wait for it with a timeout.

Daemon threads, so a call stuck on a dead peer never keeps the interpreter alive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from wtcore.errors import TransferTimeoutError

__all__ = ["BackgroundCall"]

T = TypeVar("T")


class BackgroundCall(Generic[T]):
    """``fn(*args, **kwargs)`` running on a daemon thread."""

    def __init__(self, fn: Callable[..., T], *args: Any, name: str = "", **kwargs: Any) -> None:
        self.name = name or getattr(fn, "__name__", "call")
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

        def _run() -> None:
            try:
                self._result = fn(*args, **kwargs)
            except BaseException as e:  # handed to the waiter, never lost
                self._error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=_run, name=f"wtcore-{self.name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """The exception the call raised, if it has finished with one (never blocks)."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds; True if the call has finished."""
        return self._done.wait(timeout)

    def result(self, timeout: float) -> T:
        """The call's result; re-raises its exception, or raises on timeout."""
        if not self._done.wait(timeout):
            raise TransferTimeoutError(f"{self.name} did not return within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
