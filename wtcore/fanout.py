"""Call every receiver concurrently and report all failures in one error.

Shared by the in-process, HTTP and Ray clients: a data-parallel trainer must know *which*
replicas failed, and a dead one must cost one timeout, not one per replica.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from wtcore.concurrency import BackgroundCall
from wtcore.errors import ReceiverError, ReceiverFailure

__all__ = ["FanOutClient", "failure_of", "fan_out"]

T = TypeVar("T")


def failure_of(receiver: str, error: BaseException) -> ReceiverFailure:
    """A :class:`ReceiverFailure` for ``error``, keeping a ``status`` attribute if it has one."""
    status = getattr(error, "status", None)
    return ReceiverFailure(
        receiver=receiver,
        message=str(error) or repr(error),
        status=status if isinstance(status, int) else None,
        error_type=type(error).__name__,
    )


#: After one receiver has failed, how long the others still get before the call gives up.
FAIL_FAST_S = 5.0


def fan_out(
    call: str,
    targets: Sequence[tuple[str, Callable[[], T]]],
    *,
    timeout_s: float,
    fail_fast_s: float | None = FAIL_FAST_S,
) -> list[T]:
    """Run each ``(label, fn)`` concurrently; return results in order or raise ReceiverError.

    Every call runs on a daemon helper thread (any of them can block) and all share one
    deadline. Once one receiver has failed the round is lost anyway, so the others get only
    ``fail_fast_s`` more seconds: a trainer hears about a dead replica in seconds, not after
    the peers' rendezvous timeout. ``fail_fast_s=None`` waits for everyone.
    """
    calls = [BackgroundCall(fn, name=f"{call}@{label}") for label, fn in targets]
    deadline = time.monotonic() + timeout_s
    first_failure: str | None = None
    pending = set(range(len(calls)))
    while pending and time.monotonic() < deadline:
        for i in list(pending):
            if calls[i].wait(0.005):
                pending.discard(i)
                if calls[i].error is not None and first_failure is None:
                    first_failure = targets[i][0]
                    if fail_fast_s is not None:
                        deadline = min(deadline, time.monotonic() + fail_fast_s)
    failures: list[ReceiverFailure] = []
    results: list[T] = []
    for i, ((label, _), bg) in enumerate(zip(targets, calls, strict=True)):
        if i in pending:
            reason = (
                f"still running {fail_fast_s:g} s after {first_failure} failed"
                if first_failure is not None
                else f"no answer within {timeout_s:g} s"
            )
            failures.append(ReceiverFailure(label, reason, error_type="TransferTimeoutError"))
        elif bg.error is not None:
            failures.append(failure_of(label, bg.error))
        else:
            results.append(bg.result(0))
    if failures:
        raise ReceiverError(call, failures, total=len(targets))
    return results


class FanOutClient(ABC):
    """The four protocol calls (plus ``checksums``), each sent to every receiver at once.

    Subclasses say how to reach receiver ``i`` with :meth:`_targets`; the fan-out, the shared
    deadline and the single :class:`ReceiverError` come from here.
    """

    timeout_s: float

    @abstractmethod
    def _targets(self, call: str, *args: Any) -> list[tuple[str, Callable[[], Any]]]:
        """``(label, thunk)`` per receiver, each thunk making ``call(*args)`` on it."""

    def _deadline_s(self) -> float:
        """The fan-out's own deadline (a backstop when each call bounds itself)."""
        return self.timeout_s

    def _each(self, call: str, *args: Any) -> list[Any]:
        return fan_out(call, self._targets(call, *args), timeout_s=self._deadline_s())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", weight_version)

    def checksums(self) -> list[dict[str, str]]:
        """``{name: digest}`` per receiver, in order."""
        return self._each("checksums")
