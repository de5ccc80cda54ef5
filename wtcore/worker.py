"""The receiver state machine that every transport delegates to.

HTTP servers, Ray actors and in-process tests all wrap one :class:`WeightSyncWorker`, so the
rules live in one place:

* calls arrive in the order init -> (start -> update* -> finish)*; anything else is a
  :class:`~wtcore.errors.ProtocolStateError` (HTTP 409) and changes nothing;
* a bad payload is a :class:`~wtcore.errors.PayloadError` (HTTP 400), raised before anything
  is received or applied, and the round stays open;
* from the first update a round applies until its finish, the weights are reported
  *inconsistent* (they may be mixed); any other failure inside a round ends the round, and an
  ``init_weight_transfer_engine`` mid-round abandons it, leaving them inconsistent until a
  later round finishes (the recovery contract, see ``docs/protocol.md``);
* ``weight_version`` is published only by a successful finish;
* with ``transactional=True`` a round is staged and applied only at finish, so a failed round
  leaves the old weights serving and the receiver consistent (see :mod:`wtcore.staging`).

State reads (:meth:`weight_info`) never wait for a long call to end.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from wtcore.digest import digest_named
from wtcore.engine import WeightTransferConfig, WeightTransferEngine
from wtcore.errors import PayloadError, ProtocolStateError
from wtcore.guards import FiniteCheckSink
from wtcore.sink import ReadableSink, WeightSink
from wtcore.staging import StagingSink

__all__ = ["WeightSyncWorker", "WorkerState"]


class WorkerState(str, enum.Enum):
    UNINITIALIZED = "uninitialized"
    IDLE = "idle"
    UPDATING = "updating"
    CLOSED = "closed"


class WeightSyncWorker:
    """One inference worker's end of the protocol; also an in-process ``WeightSyncClient``."""

    def __init__(
        self,
        config: WeightTransferConfig | str | Mapping[str, Any],
        sink: WeightSink,
        *,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        transactional: bool = False,
        reject_nonfinite: bool = False,
    ) -> None:
        from wtcore.factory import WeightTransferEngineFactory

        self.config = WeightTransferConfig.coerce(config)
        self.sink = sink
        self.rank = rank
        self.world_size = world_size
        self.transactional = transactional
        self.reject_nonfinite = reject_nonfinite
        # The engine loads into a chain: [finite check] -> [staging] -> the user's sink.
        self._staging: StagingSink | None = None
        engine_sink: WeightSink = sink
        if transactional:
            engine_sink = self._staging = StagingSink(sink)  # type: ignore[arg-type]
        if reject_nonfinite:
            engine_sink = FiniteCheckSink(engine_sink)
        self.engine: WeightTransferEngine[Any, Any] = WeightTransferEngineFactory.create_engine(
            self.config, sink=engine_sink, device=device, rank=rank, world_size=world_size
        )
        self._state = WorkerState.UNINITIALIZED
        self._busy: str | None = None
        self._lock = threading.Lock()
        self._version: str | None = None
        self._consistent = True
        self._last_error: str | None = None
        self._rounds_ok = 0
        self._rounds_failed = 0
        self._updates_in_round = 0

    # ------------------------------------------------------------------ state handling
    @property
    def state(self) -> WorkerState:
        return self._state

    @contextmanager
    def _call(self, name: str, allowed: tuple[WorkerState, ...], hint: str) -> Iterator[None]:
        """Admit one call at a time, and only from an allowed state."""
        with self._lock:
            if self._busy is not None:
                raise ProtocolStateError(f"{name}: rejected, {self._busy} is still running")
            if self._state not in allowed:
                raise ProtocolStateError(
                    f"{name}: not allowed in state {self._state.value!r}; {hint}"
                )
            self._busy = name
        try:
            yield
        finally:
            with self._lock:
                self._busy = None

    def _fail_round(self, name: str, error: BaseException, *, sink_touched: bool = False) -> None:
        if self._state is not WorkerState.CLOSED:  # a shutdown mid-call stays final
            self._state = WorkerState.IDLE
        if self._staging is not None and not sink_touched:
            self._staging.rollback()  # the old weights keep serving, untouched
        else:
            self._consistent = False
        self._rounds_failed += 1
        self._last_error = f"{name}: {type(error).__name__}: {error}"

    # ------------------------------------------------------------------ the protocol
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the data plane. Allowed again between rounds (re-init after a failure)."""
        with self._call(
            "init_weight_transfer_engine",
            (WorkerState.UNINITIALIZED, WorkerState.IDLE, WorkerState.UPDATING),
            "the worker is shut down",
        ):
            typed = self.engine.parse_init_info(init_info)
            if self._state is WorkerState.UPDATING:
                # A trainer that failed mid-round re-initializes: the open round is abandoned.
                self._fail_round("init_weight_transfer_engine", RuntimeError("round abandoned"))
            if self._state is WorkerState.IDLE:
                self.engine.shutdown()
            self._state = WorkerState.UNINITIALIZED
            try:
                self.engine.init_transfer_engine(typed)
            except BaseException as e:
                self._last_error = f"init_weight_transfer_engine: {type(e).__name__}: {e}"
                raise
            self._state = WorkerState.IDLE

    def start_weight_update(self) -> None:
        with self._call(
            "start_weight_update",
            (WorkerState.IDLE,),
            "call init_weight_transfer_engine first"
            if self._state is WorkerState.UNINITIALIZED
            else "a round is already in progress (start was called twice?)",
        ):
            self.engine.start_weight_update()
            if self._staging is not None:
                self._staging.begin()
            self._state = WorkerState.UPDATING
            self._updates_in_round = 0

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive and load one update; a list holds one entry per worker rank."""
        with self._call(
            "update_weights", (WorkerState.UPDATING,), "call start_weight_update first"
        ):
            entry = self._entry_for_rank(update_info)
            typed = self.engine.parse_update_info(entry)  # PayloadError: round stays open
            if self._staging is None:
                # From the first byte applied until finish, the model may be half new, half
                # old: say so, so that a round abandoned later never reads as consistent.
                self._consistent = False
            try:
                self.engine.receive_weights(typed)
            except BaseException as e:
                # Even when the sink refused this batch before writing it, earlier updates
                # of the round may be applied: the round is over and the weights may be mixed.
                self._fail_round("update_weights", e)
                raise
            self._updates_in_round += 1

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._call(
            "finish_weight_update", (WorkerState.UPDATING,), "call start_weight_update first"
        ):
            if weight_version is not None and not isinstance(weight_version, str):
                raise PayloadError(
                    f"weight_version: expected a string or null, got {weight_version!r}"
                )
            try:
                self.engine.finish_weight_update()
            except BaseException as e:
                self._fail_round("finish_weight_update", e)
                raise
            if self._staging is not None:
                try:
                    self._staging.commit()
                except BaseException as e:
                    self._fail_round("finish_weight_update (commit)", e, sink_touched=True)
                    raise
            self._state = WorkerState.IDLE
            self._version = weight_version
            self._consistent = True
            self._last_error = None
            self._rounds_ok += 1

    def abort_weight_update(self, reason: str = "aborted by caller") -> None:
        """End an open round without publishing; the weights are reported inconsistent."""
        with self._lock:
            if self._state is WorkerState.UPDATING and self._busy is None:
                self._fail_round("abort_weight_update", RuntimeError(reason))

    def _entry_for_rank(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        if isinstance(update_info, list):
            if len(update_info) != self.world_size:
                raise PayloadError(
                    f"update_info: a list must hold one entry per worker rank, expected "
                    f"{self.world_size}, got {len(update_info)}"
                )
            entry = update_info[self.rank]
            if not isinstance(entry, dict):
                raise PayloadError(
                    f"update_info[{self.rank}]: expected a JSON object, got {type(entry).__name__}"
                )
            return entry
        if not isinstance(update_info, dict):
            raise PayloadError(
                f"update_info: expected a JSON object or a list of them, got "
                f"{type(update_info).__name__}"
            )
        return update_info

    # ------------------------------------------------------------------ introspection
    def weight_info(self) -> dict[str, Any]:
        """The published version and whether the weights are consistent (never blocks)."""
        return {
            "weight_version": self._version,
            "consistent": self._consistent,
            "state": self._state.value,
            "busy": self._busy,
            "last_error": self._last_error,
            "rounds_ok": self._rounds_ok,
            "rounds_failed": self._rounds_failed,
            "backend": self.config.backend,
            "rank": self.rank,
            "world_size": self.world_size,
            "transactional": self.transactional,
        }

    def checksums(self) -> dict[str, str]:
        """``{name: digest}`` of what the sink holds (see :mod:`wtcore.digest`).

        During a transactional round this is what ``finish`` would publish (staged tensors
        over current ones), so a trainer can verify a round before finishing it.
        """
        readable: object = self.sink
        if self._staging is not None and self._state is WorkerState.UPDATING:
            readable = self._staging
        if not isinstance(readable, ReadableSink):
            raise TypeError(
                f"checksums need a sink with named_tensors(); {type(self.sink).__name__} has none"
            )
        return digest_named(readable.named_tensors())

    def shutdown(self) -> None:
        """Release the engine. Idempotent; the worker cannot be used afterwards."""
        with self._lock:
            if self._state is WorkerState.CLOSED:
                return
            if self._state is WorkerState.UPDATING:
                self._fail_round("shutdown", RuntimeError("shut down mid-round"))
            self._state = WorkerState.CLOSED
        self.engine.shutdown()
