"""Call every receiver concurrently and report all failures in one error.

The one fan-out, shared by every client: a trainer must know *which* replicas failed, and a
dead one must cost one timeout, not one per replica.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import ErrorRecord, PayloadError, ReceiverError, ReceiverFailure, WtcoreError
from wtcore.rounds import new_round_id
from wtcore_kit.concurrency import BackgroundCall

__all__ = [
    "ABORT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "FAIL_FAST_S",
    "FanOutClient",
    "PerReceiver",
    "failure_of",
    "fan_out",
    "receiver_args",
    "split_by_receiver",
]

T = TypeVar("T")

_NO_STATUS = object()


def failure_of(receiver: str, error: BaseException) -> ReceiverFailure:
    """A :class:`ReceiverFailure` for ``error``, under the peer's own error class and status
    where it sent a record (an HTTP answer's ``status`` wins; ``None`` there: no answer)."""
    record = ErrorRecord.from_exception(error)
    status: Any = getattr(error, "status", _NO_STATUS)
    if status is _NO_STATUS:
        status = record.status if isinstance(error, WtcoreError) else None
    return ReceiverFailure(
        receiver=receiver,
        message=record.message or repr(error),
        status=status if isinstance(status, int) else None,
        error_type=record.type,
        timed_out=isinstance(error, TimeoutError) or getattr(error, "timed_out", False) is True,
    )


#: After one receiver has failed, how long the others still get before the call gives up.
FAIL_FAST_S = 5.0
#: The bound of a best-effort abort after a failed round: a silent receiver must not hold the
#: trainer's error back by a whole timeout.
ABORT_TIMEOUT_S = FAIL_FAST_S

#: ``(label, thunk)``: one call on one receiver; a thunk's ``cancel()``, if any, is called
#: (best effort) when :func:`fan_out` gives up on it.
Target = tuple[str, Callable[[], T]]


def fan_out(
    call: str,
    targets: Sequence[Target[T]],
    *,
    timeout_s: float,
    fail_fast_s: float | None = FAIL_FAST_S,
    describe: Callable[[str, BaseException], ReceiverFailure] = failure_of,
) -> list[T]:
    """Run each ``(label, fn)`` on a daemon thread; return results in order or raise one
    :class:`~wtcore.errors.ReceiverError`. Once one failed, the round is lost anyway, so the
    others get ``fail_fast_s`` more (``None``: no limit), not the peers' rendezvous timeout."""
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
    for i, ((label, fn), bg) in enumerate(zip(targets, calls, strict=True)):
        if i in pending:
            reason = (
                f"still running {fail_fast_s:g} s after {first_failure} failed"
                if first_failure is not None
                else f"no answer within {timeout_s:g} s"
            )
            failures.append(
                ReceiverFailure(label, reason, error_type="TransferTimeoutError", timed_out=True)
            )
            cancel = getattr(fn, "cancel", None)
            if callable(cancel):
                with contextlib.suppress(Exception):
                    cancel()
        elif bg.error is not None:
            failures.append(describe(label, bg.error))
        else:
            results.append(bg.result(0))
    if failures:
        raise ReceiverError.of(call, failures, total=len(targets))
    return results


@dataclass(frozen=True)
class PerReceiver:
    """An argument that differs per receiver: receiver ``i`` gets ``items[i]``
    (:func:`receiver_args`)."""

    items: tuple[Any, ...]


def receiver_args(args: tuple[Any, ...], i: int) -> tuple[Any, ...]:
    """``args`` as receiver ``i`` gets them: each :class:`PerReceiver` replaced by its item."""
    return tuple(a.items[i] if isinstance(a, PerReceiver) else a for a in args)


def split_by_receiver(entries: list[Any], receivers: int) -> PerReceiver:
    """A rank-indexed ``update_info`` list cut into each receiver's block (the entry itself
    when it hosts one rank): per-rank payloads name memory and peers of that rank only."""
    if not entries or len(entries) % receivers:
        raise PayloadError(
            f"update_info: a list of {len(entries)} entries does not split evenly over "
            f"{receivers} receivers (one entry per worker rank, every receiver hosting as many)"
        )
    for j, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise PayloadError(
                f"update_info[{j}]: expected a JSON object, got {type(entry).__name__}"
            )
    k = len(entries) // receivers
    return PerReceiver(
        tuple(entries[i] if k == 1 else entries[i * k : (i + 1) * k] for i in range(receivers))
    )


_C = TypeVar("_C", bound="FanOutClient")


class FanOutClient(ABC):
    """Both client protocols, each call sent to every receiver at once; subclasses implement
    :meth:`_targets` and :meth:`get_world_size`."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    fail_fast_s: float | None = FAIL_FAST_S
    #: The id of the round this client started and has not finished (``None``: none open).
    round_id: str | None = None

    @abstractmethod
    def _targets(self, call: str, *args: Any, **kwargs: Any) -> list[Target[Any]]:
        """``(label, thunk)`` per receiver ``i``: ``call(*receiver_args(args, i), **kwargs)``."""

    def _receiver_count(self) -> int:
        """How many receivers :meth:`_targets` reaches (by default, one per worker rank)."""
        return self.get_world_size()

    def _deadline_s(self) -> float:
        """The fan-out's own deadline (a backstop when each call bounds itself)."""
        return self.timeout_s

    def _describe(self, label: str, error: BaseException) -> ReceiverFailure:
        """How a receiver's exception is reported (a transport may unwrap its own errors)."""
        return failure_of(label, error)

    def _each(self, call: str, *args: Any, **kwargs: Any) -> list[Any]:
        return fan_out(
            call,
            self._targets(call, *args, **kwargs),
            timeout_s=self._deadline_s(),
            fail_fast_s=self.fail_fast_s,
            describe=self._describe,
        )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.round_id = None  # an init abandons any round this client had open
        self._each("init_weight_transfer_engine", init_info, round_id=new_round_id())

    def start_weight_update(self) -> None:
        # Set before the call: if only some receivers start, the abort must still carry it.
        self.round_id = new_round_id()
        self._each("start_weight_update", round_id=self.round_id)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """A dict goes to all; a rank-indexed list is cut per receiver."""
        payload: Any = update_info
        if isinstance(update_info, list):
            payload = split_by_receiver(update_info, self._receiver_count())
        self._each("update_weights", payload, round_id=self.round_id)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", weight_version, round_id=self.round_id)
        self.round_id = None

    def update_weight_version(self, new_version: str) -> None:
        """Rename the version every receiver holds, between rounds (vLLM's route)."""
        self._each("update_weight_version", new_version, round_id=new_round_id())

    def weight_info(self) -> list[dict[str, Any]]:
        return self._each("weight_info")

    def checksums(self) -> list[dict[str, str]]:
        return self._each("checksums")

    def abort_weight_update(self, reason: str = "aborted by the trainer") -> None:
        """End this client's open round (else an unowned one) on every receiver; best effort,
        bounded by :data:`ABORT_TIMEOUT_S`."""
        try:
            fan_out(
                "abort_weight_update",
                self._targets("abort_weight_update", reason, round_id=self.round_id),
                timeout_s=min(self._deadline_s(), ABORT_TIMEOUT_S),
                fail_fast_s=self.fail_fast_s,
                describe=self._describe,
            )
        finally:
            self.round_id = None

    @abstractmethod
    def get_world_size(self) -> int: ...

    def close(self) -> None:
        """Release the client's own resources; the receivers keep running."""
        return None

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
