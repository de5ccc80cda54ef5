"""The receiver state machine that every transport delegates to.

HTTP servers, Ray actors and in-process tests all wrap one :class:`WeightSyncWorker`, so the
rules of docs/protocol.md live in one place: the call order (anything else is a
:class:`~wtcore.errors.ProtocolStateError` that changes nothing), bad payloads refused before
anything is applied, round ownership, the round deadline, preemption by a new init, the
recovery contract (``consistent`` is true only over one trainer's complete rounds), staged
rounds (:mod:`wtcore.staging`, docs/staged.md) and each round's paused time. State reads
(:meth:`weight_info`) never wait for a long call to end.
"""

from __future__ import annotations

import enum
import hmac
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from wtcore.defaults import DEFAULT_TIMEOUT_S, check_timeout
from wtcore.digest import digest_named
from wtcore.engine import WeightTransferConfig, WeightTransferEngine
from wtcore.errors import PayloadError, ProtocolStateError, TransferTimeoutError
from wtcore.finite import FiniteCheckSink
from wtcore.ledger import ByteLedger
from wtcore.registry import RECEIVER_LAYERS
from wtcore.rounds import (
    PREPARE_KEY,
    ROUND_KEY,
    STAGED_KEY,
    check_required,
    check_round_id,
    check_weight_version,
    drop_round,
    round_stamp,
)
from wtcore.sink import LaidOutSink, ReadableSink, WeightSink
from wtcore.staging import StagingSink
from wtcore.stats import ROUND_TIMES

__all__ = [
    "DEFAULT_PREEMPT_TIMEOUT_S",
    "DEFAULT_ROUND_TIMEOUT_S",
    "ReceiverLayer",
    "WeightSyncWorker",
    "WorkerState",
]

#: How long an open round may go without a call before it is abandoned (seconds).
DEFAULT_ROUND_TIMEOUT_S = DEFAULT_TIMEOUT_S
#: How long an init waits for a call it preempted to end (seconds).
DEFAULT_PREEMPT_TIMEOUT_S = 30.0


def _check_seconds(name: str, value: object) -> float:
    try:
        return check_timeout(name, value)
    except ValueError as e:
        raise PayloadError(str(e)) from None


class ReceiverLayer(WeightSink, Protocol):
    """The receiver half of a round policy: a sink the worker puts first in its chain.

    Found through :data:`wtcore.registry.RECEIVER_LAYERS`, so the worker imports no policy; built
    with ``for_chain(chain, sink, staging)``. A layer may refuse a round (a
    :class:`~wtcore.errors.ProtocolStateError`) while ``applied`` is still False: nothing
    reached the chain, so the published consistency stands.
    """

    #: Whether this receiver takes the layer's rounds (reported in ``weight_info``).
    accepts: bool
    #: Whether anything of the open round reached the chain.
    applied: bool

    def begin(self, version: str | None, consistent: bool) -> None:
        """A round starts over weights of ``version`` (``consistent`` as published)."""

    def finish(self) -> None:
        """The round is about to be published: raise if the layer's round is incomplete."""


class WorkerState(str, enum.Enum):
    UNINITIALIZED = "uninitialized"
    IDLE = "idle"
    UPDATING = "updating"
    CLOSED = "closed"


class WeightSyncWorker:
    """One inference worker's end of the protocol; also an in-process ``WeightSyncClient``.

    ``round_timeout_s`` (default :data:`DEFAULT_ROUND_TIMEOUT_S`) is how long an open round
    may go without a call before it is abandoned; ``None`` turns the deadline off.
    ``preempt_timeout_s`` bounds how long an init waits for a call it preempted to end.
    ``require_round_id`` refuses unowned rounds: an init, start, update or finish without a
    round id (:mod:`wtcore.rounds`) is a :class:`~wtcore.errors.ProtocolStateError` (HTTP 409),
    for a receiver that serves only wtcore trainers.
    """

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
        round_timeout_s: float | None = DEFAULT_ROUND_TIMEOUT_S,
        preempt_timeout_s: float = DEFAULT_PREEMPT_TIMEOUT_S,
        require_round_id: bool = False,
    ) -> None:
        from wtcore.factory import WeightTransferEngineFactory

        if not isinstance(require_round_id, bool):
            raise PayloadError(f"require_round_id: expected a bool, got {require_round_id!r}")
        self.require_round_id = require_round_id
        self.config = WeightTransferConfig.coerce(config)
        self.sink = sink
        self.rank = rank
        self.world_size = world_size
        self.transactional = transactional
        self.reject_nonfinite = reject_nonfinite
        self.round_timeout_s = (
            None if round_timeout_s is None else _check_seconds("round_timeout_s", round_timeout_s)
        )
        self.preempt_timeout_s = _check_seconds("preempt_timeout_s", preempt_timeout_s)
        # The engine loads into a chain: [receiver layers] -> [finite check] -> [staging] ->
        # the user's sink. The layers are the installed round policies' receiver halves.
        self._staging: StagingSink | None = None
        engine_sink: WeightSink = sink
        if transactional:
            engine_sink = self._staging = StagingSink(sink)  # type: ignore[arg-type]
        if reject_nonfinite:
            engine_sink = FiniteCheckSink(engine_sink)
        self._layers: list[tuple[str, ReceiverLayer]] = []
        for layer_name in RECEIVER_LAYERS.names():
            layer = RECEIVER_LAYERS.load(layer_name).for_chain(engine_sink, sink, self._staging)
            self._layers.append((layer_name, layer))
            engine_sink = layer
        # What the engine delivers; each update's announcement also reaches the layers.
        engine_sink = self._ledger = ByteLedger(engine_sink, [x for _, x in self._layers])
        self.engine: WeightTransferEngine[Any, Any] = WeightTransferEngineFactory.create_engine(
            self.config, sink=engine_sink, device=device, rank=rank, world_size=world_size
        )
        self.engine.receiver_layout = (
            sink.receiver_layout() if isinstance(sink, LaidOutSink) else None
        )
        self._state = WorkerState.UNINITIALIZED
        self._busy: str | None = None
        # One lock guards every field below; the condition wakes an init waiting for a call
        # it preempted. ``_generation`` changes whenever a running call is preempted, so that
        # call can tell, when it returns, that it must not touch the state any more.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._generation = 0
        self._inside = 0
        self._stuck = False
        #: An abort that arrived while a call of the round ran: (that call's generation, why).
        self._abort_pending: tuple[int, str] | None = None
        self._version: str | None = None
        self._consistent = True
        # Names that may hold no published version (after a reset, a failed or abandoned
        # round): a later round is consistent only once rounds have written all of them.
        self._unwritten: set[str] = set()
        self._last_error: str | None = None
        self._rounds_ok = 0
        self._rounds_failed = 0
        self._updates_in_round = 0
        self._touched = False  # whether an update of the open round reached the engine
        self._committing = False  # a transactional finish is writing the staged round
        self._prepared = False  # the open round passed its prepare: only the commit is left
        # When the open round started and first wrote the live weights (monotonic), and the
        # last finished round's times (weight_info).
        self._started_at = 0.0
        self._live_from: float | None = None
        self._times: dict[str, float | None] = dict.fromkeys(ROUND_TIMES)
        # The open round's owner (None: unowned), its deadline, and the last ended round's
        # id with why it ended (for a clear error to a caller that still thinks it is open).
        self._round_id: str | None = None
        self._deadline: float | None = None
        self._timer: threading.Timer | None = None
        self._ended: tuple[str, str] | None = None

    # ------------------------------------------------------------------ state handling
    @property
    def state(self) -> WorkerState:
        return self._state

    def _admit(self, name: str, allowed: tuple[WorkerState, ...], hint: str) -> None:
        """Under the lock: refuse a call while another runs or from a wrong state."""
        if self._busy is not None:
            raise ProtocolStateError(f"{name}: rejected, {self._busy} is still running")
        if self._state not in allowed:
            raise ProtocolStateError(f"{name}: not allowed in state {self._state.value!r}; {hint}")

    @contextmanager
    def _call(
        self,
        name: str,
        allowed: tuple[WorkerState, ...],
        hint: str,
        *,
        round_id: str | None = None,
        owned: bool = False,
        preempt: bool = False,
    ) -> Iterator[int]:
        """Admit one call at a time, from an allowed state, and (``owned``) only its owner.

        With ``preempt`` a running call is preempted instead of refusing this one. Yields the
        generation the call runs in; :meth:`_current` tells the call, after a long engine
        call, whether it was preempted meanwhile.
        """
        with self._lock:
            self._expire_if_due()
            if owned:
                self._check_owner(name, round_id)
            if preempt and self._busy is not None:
                self._preempt(name)
            self._admit(name, allowed, hint)
            self._busy = name
            self._inside += 1
            self._disarm()
            generation = self._generation
        try:
            yield generation
        finally:
            with self._lock:
                self._inside -= 1
                if self._generation == generation:
                    self._busy = None
                    pending, self._abort_pending = self._abort_pending, None
                    if (
                        pending is not None
                        and pending[0] == generation
                        and self._state is WorkerState.UPDATING  # the call itself succeeded
                    ):
                        self._end_round("abort_weight_update", RuntimeError(pending[1]))
                    self._arm()
                elif self._stuck and not self._inside:
                    self._stuck, self._busy = False, None  # a timed-out preemption ended
                self._idle.notify_all()

    def _round_call(self, name: str, round_id: str | None) -> AbstractContextManager[int]:
        """:meth:`_call` for a call inside the open round, by its owner only."""
        return self._call(
            name,
            (WorkerState.UPDATING,),
            "call start_weight_update first",
            round_id=round_id,
            owned=True,
        )

    def _current(self, name: str, generation: int, error: BaseException | None = None) -> None:
        """Under the lock: raise if the call of ``generation`` was preempted meanwhile."""
        if self._generation != generation:
            raise ProtocolStateError(
                f"{name}: preempted by a later init_weight_transfer_engine; nothing of this "
                "call was published"
                + (f" (it then ended with {type(error).__name__}: {error})" if error else "")
            ) from error

    def _call_failed(
        self, name: str, generation: int, error: BaseException, *, sink_touched: bool = False
    ) -> None:
        """A call of the round failed: end the round, or say it had been preempted."""
        with self._lock:
            self._current(name, generation, error)
            self._fail_round(name, error, sink_touched=sink_touched)

    def _check_owner(self, name: str, round_id: str | None) -> None:
        """Under the lock: only the round's owner may continue it (see :mod:`wtcore.rounds`)."""
        round_id = check_round_id(round_id)
        if name != "abort_weight_update":  # an id-less abort ends an unowned round only
            check_required(name, round_id, self.require_round_id)
        if self._state is not WorkerState.UPDATING:
            if round_id is not None and self._ended is not None and self._ended[0] == round_id:
                raise ProtocolStateError(
                    f"{name}: refused, this round is no longer open ({self._ended[1]}); "
                    "nothing was applied"
                )
            return  # the state check names what is wrong
        owner = self._round_id
        if owner is None and round_id is None:
            return
        if owner is not None and round_id is not None and hmac.compare_digest(owner, round_id):
            return
        if owner is None:
            why = "the open round was started without a round id, this call carries one"
        elif round_id is None:
            why = "the open round belongs to another trainer and this call carries no round id"
        elif self._ended is not None and self._ended[0] == round_id:
            why = f"this call's round is no longer open ({self._ended[1]})"
        else:
            why = "the open round belongs to another trainer (round id mismatch)"
        raise ProtocolStateError(f"{name}: refused, {why}; nothing was applied")

    # ------------------------------------------------------------------ the round deadline
    def _arm(self) -> None:
        """Under the lock: (re)start the open round's idle deadline.

        One daemon timer per round at most: it sleeps until the deadline, and when a later
        call moved the deadline it sleeps again for the rest (no thread per call).
        """
        if self._state is not WorkerState.UPDATING or self.round_timeout_s is None:
            return
        self._deadline = time.monotonic() + self.round_timeout_s
        if self._timer is None:
            self._schedule(self.round_timeout_s)

    def _schedule(self, delay: float) -> None:
        timer = threading.Timer(delay + 0.01, self._on_timer)
        timer.daemon = True
        timer.name = "wtcore-round-deadline"
        self._timer = timer
        timer.start()

    def _disarm(self) -> None:
        """Under the lock: no deadline while a call runs (each call bounds itself)."""
        self._deadline = None

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            self._expire_if_due()
            if self._deadline is not None and self._state is WorkerState.UPDATING:
                self._schedule(max(0.0, self._deadline - time.monotonic()))

    def _expire_if_due(self) -> None:
        """Under the lock: abandon an open round whose deadline has passed."""
        if (
            self._state is WorkerState.UPDATING
            and self._busy is None
            and self._deadline is not None
            and time.monotonic() >= self._deadline
        ):
            self._end_round(
                "round deadline",
                RuntimeError(
                    f"no call for {self.round_timeout_s:g} s (round_timeout_s): the round was "
                    "abandoned, its trainer is presumed dead"
                ),
            )

    def _end_round(self, name: str, error: BaseException) -> None:
        """Under the lock, no call running: abandon the open round and let the engine clean up."""
        self._fail_round(name, error)
        self.engine.abort()

    def _fail_round(self, name: str, error: BaseException, *, sink_touched: bool = False) -> None:
        if self._state is not WorkerState.CLOSED:  # a shutdown mid-call stays final
            self._state = WorkerState.IDLE
        if self._staging is not None and not sink_touched and not self._committing:
            self._staging.rollback()  # the old weights keep serving, untouched
        elif self._touched or sink_touched:
            self._mark_mixed()  # (a round that began no update changed nothing)
        self._rounds_failed += 1
        self._last_error = f"{name}: {type(error).__name__}: {error}"
        if self._round_id is not None:
            self._ended = (self._round_id, self._last_error)
        self._round_id = None
        self._disarm()

    def _placed(self) -> None:
        """Under the lock, between rounds: take the sink's layout as it is now (an expert
        placement may change between rounds, without a restart); a changed one may hold
        tensors no round wrote yet, so the weights are mixed until a round writes them all."""
        layout = self.sink.receiver_layout() if isinstance(self.sink, LaidOutSink) else None
        if layout != self.engine.receiver_layout:
            self.engine.receiver_layout = layout
            self._mark_mixed()

    def _mark_mixed(self) -> None:
        """Under the lock: the weights may be mixed; every tensor must be written again before
        they are reported consistent (a partial round after this publishes, inconsistent)."""
        self._consistent = False
        if isinstance(self.sink, ReadableSink):
            self._unwritten = {n for n, t in self.sink.named_tensors() if t.numel()}

    def _preempt(self, name: str) -> None:
        """Under the lock: end the running call early (engine ``abort``) and wait for it.

        The round it belonged to is abandoned at once, so the state is honest even if the
        call takes a while to notice; the call itself, when it returns, changes nothing
        (:meth:`_current`). Raises if it has not left the engine within ``preempt_timeout_s``
        (engine calls are not reentrant, so this call cannot start before).
        """
        running = self._busy
        self._generation += 1
        self._busy = f"{name} (preempting {running})"
        if self._state is WorkerState.UPDATING:
            self._fail_round(name, RuntimeError(f"round abandoned while {running} was running"))
        self._lock.release()
        try:
            self.engine.abort()
        finally:
            self._lock.acquire()
        deadline = time.monotonic() + self.preempt_timeout_s
        while self._inside:
            left = deadline - time.monotonic()
            if left <= 0:
                self._busy = f"{running} (preempted, still ending)"  # nothing else starts
                self._stuck = True
                raise TransferTimeoutError(
                    f"{name}: {running} did not end within {self.preempt_timeout_s:g} s of "
                    "being preempted (preempt_timeout_s); its round is abandoned, retry later"
                )
            self._idle.wait(left)
        self._busy = None

    # ------------------------------------------------------------------ the protocol
    def init_weight_transfer_engine(
        self, init_info: dict[str, Any], *, round_id: str | None = None
    ) -> None:
        """Join the data plane. Allowed again at any time (re-init after a failure).

        Mid-round it abandons the open round; while another call runs it preempts that call
        (see :meth:`_preempt`), so a trainer can always recover a receiver. ``round_id`` is
        checked only for its form and, with ``require_round_id``, for its presence: an init
        belongs to no round.
        """
        name = "init_weight_transfer_engine"
        check_required(name, check_round_id(round_id), self.require_round_id)
        typed = self.engine.parse_init_info(init_info)  # PayloadError: nothing changes
        with self._call(
            name,
            (WorkerState.UNINITIALIZED, WorkerState.IDLE, WorkerState.UPDATING),
            "the worker is shut down",
            preempt=True,
        ) as generation:
            if self._state is WorkerState.UPDATING:
                # A trainer that failed mid-round re-initializes: the open round is abandoned.
                self._end_round(name, RuntimeError("round abandoned by a new init"))
            if self._state is WorkerState.IDLE:
                self.engine.shutdown()
            self._state = WorkerState.UNINITIALIZED
            try:
                self.engine.init_transfer_engine(typed)
            except BaseException as e:
                with self._lock:
                    self._current(name, generation, e)
                    self._last_error = f"{name}: {type(e).__name__}: {e}"
                raise
            with self._lock:
                self._current(name, generation)
                self._state = WorkerState.IDLE

    def start_weight_update(self, *, round_id: str | None = None) -> None:
        """Open a round; ``round_id`` (see :mod:`wtcore.rounds`) makes the caller its owner."""
        round_id = check_round_id(round_id)
        check_required("start_weight_update", round_id, self.require_round_id)
        with self._call(
            "start_weight_update",
            (WorkerState.IDLE,),
            "call init_weight_transfer_engine first"
            if self._state is WorkerState.UNINITIALIZED
            else "a round is already in progress (start was called twice?)",
        ):
            with self._lock:
                self._placed()
            self.engine.start_weight_update()
            if self._staging is not None:
                self._staging.begin()
            for _, layer in self._layers:
                layer.begin(self._version, self._consistent)
            self._ledger.begin()
            self._state = WorkerState.UPDATING
            self._updates_in_round = 0
            self._touched = self._prepared = False
            self._round_id = round_id
            self._started_at, self._live_from = time.monotonic(), None

    def update_weights(
        self,
        update_info: dict[str, Any] | list[dict[str, Any]],
        *,
        round_id: str | None = None,
    ) -> None:
        """Receive and load one update; a list holds one entry per worker rank.

        A round id stamped into ``update_info`` (:data:`~wtcore.rounds.ROUND_KEY`) stands for
        ``round_id`` when none is given (a transport that drops the header), and must equal it
        when one is.
        """
        name = "update_weights"
        stamped, given = round_stamp(update_info), check_round_id(round_id)
        if stamped is not None and given is None:
            round_id = stamped
        elif stamped is not None and given is not None and not hmac.compare_digest(stamped, given):
            raise ProtocolStateError(
                f"{name}: refused, the round id in update_info.{ROUND_KEY} is not the call's; "
                "nothing was applied"
            )
        with self._round_call(name, round_id) as generation:
            entry = self._entry_for_rank(update_info)
            if self._staging is None and entry.get(STAGED_KEY) is True:
                raise PayloadError(
                    f"update_info.{STAGED_KEY}: this round is staged (the trainer's staged=True) "
                    "and this receiver writes its live weights; start it with "
                    "transactional=True (wtcore serve --transactional); nothing was applied"
                )
            if self._prepared:
                raise ProtocolStateError(
                    f"{name}: refused, this round was prepared; only its finish may follow"
                )
            if PREPARE_KEY in entry:
                self._prepare(generation)
                return
            typed = self.engine.parse_update_info(drop_round(entry))  # PayloadError: stays open
            self._ledger.plan(getattr(typed, "metas", None))
            self._touched = True
            was_consistent = self._consistent
            if self._staging is None:
                # From the first byte applied until finish, the model may be half new, half
                # old: say so, so that a round abandoned later never reads as consistent.
                self._consistent = False
                if self._live_from is None:
                    self._live_from = time.monotonic()
            try:
                self.engine.receive_weights(typed)
            except BaseException as e:
                first = self._layers[-1][1] if self._layers else None
                if isinstance(e, ProtocolStateError) and first is not None and not first.applied:
                    # A receiver layer refused the round (a delta round's stale base) before
                    # anything passed the first layer: nothing reached the sink.
                    self._touched, self._consistent = False, was_consistent
                # Even when the sink refused this batch before writing it, earlier updates
                # of the round may be applied: the round is over and the weights may be mixed.
                self._call_failed(name, generation, e)
                raise
            with self._lock:
                self._current(name, generation)
                self._updates_in_round += 1

    def _prepare(self, generation: int) -> None:
        """A staged round's barrier: every check its finish would run, nothing applied; after
        it only the commit is left, which cannot fail for a reason the trainer could have
        learned before committing the fleet."""
        name = "update_weights (prepare)"
        if self._staging is None:
            raise PayloadError(
                f"update_info.{PREPARE_KEY}: only a receiver that stages its rounds can prepare "
                "(transactional=True); nothing was applied"
            )
        self._require_updates(name)
        try:
            self._check_round()
        except BaseException as e:
            self._call_failed(name, generation, e)
            raise
        with self._lock:
            self._current(name, generation)
            self._prepared = True

    def _require_updates(self, name: str) -> None:
        if self._updates_in_round == 0:
            raise ProtocolStateError(
                f"{name}: refused, this round applied no update_weights; a version is "
                "published only over weights a round changed (send an update, or end the "
                "round with abort_weight_update); the round stays open"
            )

    def _check_round(self) -> None:
        """Everything that must hold before a round is published (the ledger, the layers, the
        engine's own finish)."""
        self._ledger.check()
        for _, layer in self._layers:
            layer.finish()
        self.engine.finish_weight_update()

    def finish_weight_update(
        self, weight_version: str | None = None, *, round_id: str | None = None
    ) -> None:
        """Publish ``weight_version``; refused for a round that applied no update."""
        name = "finish_weight_update"
        with self._round_call(name, round_id) as generation:
            check_weight_version(weight_version)
            self._require_updates(name)
            t0 = time.monotonic()
            try:
                if not self._prepared:
                    self._check_round()
            except BaseException as e:
                self._call_failed(name, generation, e)
                raise
            if self._staging is not None:
                # An init may preempt the commit; it must then know that the real sink is
                # being written, or it would keep the old version consistent over new bytes.
                with self._lock:
                    self._committing = True
                t0 = time.monotonic()
                try:
                    self._staging.commit()
                except BaseException as e:
                    self._call_failed(f"{name} (commit)", generation, e, sink_touched=True)
                    raise
                finally:
                    with self._lock:
                        self._committing = False
            with self._lock:
                self._current(name, generation)
                self._state = WorkerState.IDLE
                self._version = weight_version
                self._unwritten.difference_update(self._ledger.landed)
                self._consistent = not self._unwritten
                self._last_error = None
                self._rounds_ok += 1
                self._round_id = None
                self._ended = None
                self._times = self._round_times(t0, time.monotonic())

    def _round_times(self, commit_from: float, end: float) -> dict[str, float | None]:
        """A finished round's times: staged (beside the live weights), the commit, and paused
        (the live weights were no published version: the commit when staged, else from the
        first byte written to the end)."""
        commit_s = end - commit_from
        if self._staging is not None:
            return {
                "staged_s": commit_from - self._started_at,
                "commit_s": commit_s,
                "paused_s": commit_s,
            }
        live_from = self._live_from if self._live_from is not None else commit_from
        return {"staged_s": None, "commit_s": commit_s, "paused_s": end - live_from}

    def update_weight_version(self, new_version: str, *, round_id: str | None = None) -> None:
        """Rename the version of the weights held, between rounds (vLLM's route of the name).

        The weights and ``consistent`` are unchanged: a trainer that labels a step after the
        fact, or by another scheme, does so without sending the weights again. Refused during
        a round (the open round's finish names its version) and, with ``require_round_id``,
        without an id.
        """
        name = "update_weight_version"
        check_required(name, check_round_id(round_id), self.require_round_id)
        if not isinstance(new_version, str):
            raise PayloadError(f"new_version: expected a string, got {new_version!r:.60}")
        check_weight_version(new_version)
        hint = "rename between rounds (an open round's finish names its own version)"
        allowed = (WorkerState.UNINITIALIZED, WorkerState.IDLE)
        with self._call(name, allowed, hint), self._lock:
            self._version = new_version

    def abort_weight_update(
        self, reason: str = "aborted by caller", *, round_id: str | None = None
    ) -> None:
        """End an open round without publishing; the weights are reported inconsistent.

        Only the round's owner may abort an owned round. With no round open this does
        nothing. While a call of the round runs, that call is left to end on its own (a
        failure ends the round with its own error, which names the cause: a peer, a
        timeout); if it succeeds (its bytes had all arrived) the round ends as it returns, so
        a trainer that abandoned a round never leaves a receiver in it until its deadline.
        """
        with self._lock:
            self._expire_if_due()
            if self._state is not WorkerState.UPDATING:
                check_round_id(round_id)
                return
            self._check_owner("abort_weight_update", round_id)
            if self._busy is not None:
                self._abort_pending = (self._generation, reason)
                return
            self._end_round("abort_weight_update", RuntimeError(reason))

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
        if self._lock.acquire(blocking=False):  # an expired round reads as abandoned at once
            try:
                self._expire_if_due()
                if self._busy is None and self._state is not WorkerState.UPDATING:
                    self._placed()
            finally:
                self._lock.release()
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
            # How this receiver is sharded (wtcore.sharded.receiver_layout); None: whole replicas.
            "layout": self._layout_report(),
            # Bytes announced and landed in the open (or last) round, every tensor counted.
            "round_bytes": self._ledger.totals(),
            # The last finished round's seconds: staged_s, commit_s, paused_s (docs/staged.md).
            **self._times,
            # Trainers read "delta" (wtcore-delta's rounds): False unless its layer takes them.
            "delta": False,
            **{name: layer.accepts for name, layer in self._layers},
        }

    def _layout_report(self) -> dict[str, Any] | None:
        layout = self.engine.receiver_layout
        return None if layout is None else layout.to_wire()

    def reset_weights(self, *, round_id: str | None = None) -> None:
        """Zero every tensor the sink holds, between rounds (vLLM's ``weight_checker`` reset).

        A check that a sync really writes every weight: checksum, reset, sync, compare. The
        weights are then no version at all, so ``consistent`` is false until a round finishes.
        """
        name = "reset_weights"
        check_required(name, check_round_id(round_id), self.require_round_id)
        if not isinstance(self.sink, ReadableSink):
            raise PayloadError(
                f"{name} needs a sink with named_tensors(); {type(self.sink).__name__} has none"
            )
        hint = "reset between rounds"
        with self._call(name, (WorkerState.UNINITIALIZED, WorkerState.IDLE), hint):
            with self._lock:
                self._mark_mixed()
            for _, t in self.sink.named_tensors():
                t.detach().zero_()

    def weight_checker(
        self, action: str, baseline: object = None, *, round_id: str | None = None
    ) -> dict[str, Any]:
        """vLLM's ``POST /weight_checker``: ``checksum``, ``reset`` or ``compare`` (with
        ``baseline``, the ``checksums`` of an earlier ``checksum``), with vLLM's answers."""
        if action == "checksum":
            return {"checksums": self.checksums()}
        if action == "reset":
            self.reset_weights(round_id=round_id)
            return {"status": "reset"}
        if action != "compare":
            raise PayloadError(f"action: expected checksum, reset or compare, got {action!r:.40}")
        if not isinstance(baseline, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in baseline.items()
        ):
            raise PayloadError("baseline: action 'compare' needs an object of name -> checksum")
        held = self.checksums()
        mismatches = sorted(
            k for k in held.keys() | baseline.keys() if held.get(k) != baseline.get(k)
        )
        return {"match": not mismatches, "mismatches": mismatches}

    def checksums(self) -> dict[str, str]:
        """``{name: digest}`` of what the sink holds (see :mod:`wtcore.digest`).

        During a transactional round this is what ``finish`` would publish (staged tensors
        over current ones), so a trainer can verify a round before finishing it.
        """
        readable: object = self.sink
        if self._staging is not None and self._state is WorkerState.UPDATING:
            readable = self._staging
        if not isinstance(readable, ReadableSink):
            raise PayloadError(
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
