"""Round ownership (docs/protocol.md): the id a trainer's client gives its round, and how
receivers check it, so no other trainer's tensors are published as its version."""

from __future__ import annotations

import re
import secrets
import threading
from typing import Any

from wtcore.errors import PayloadError, ProtocolStateError, TransferTimeoutError

__all__ = [
    "MAX_VERSION_CHARS",
    "PREPARE_KEY",
    "ROUND_HEADER",
    "ROUND_ID_RE",
    "ROUND_KEY",
    "STAGED_KEY",
    "RoundStampingClient",
    "check_required",
    "check_round_id",
    "check_weight_version",
    "drop_round",
    "new_round_id",
    "round_stamp",
    "stamp_round",
]

#: The HTTP header that carries a round's id (vLLM ignores headers it does not know).
ROUND_HEADER = "X-Wtcore-Round"
#: The ``update_info`` key carrying the round's id in every update (vLLM drops the header).
ROUND_KEY = "wtcore_round"
#: Stamped into a staged round's updates: a receiver that does not stage refuses them.
STAGED_KEY = "wtcore_staged"
#: A staged round's last update carries only this: each receiver confirms it holds the whole
#: round (the fleet's barrier; an update, since vLLM's finish carries no body).
PREPARE_KEY = "wtcore_prepare"
#: What a round id may look like: long enough to be unguessable, safe in a header.
ROUND_ID_RE = re.compile(r"[A-Za-z0-9_-]{16,128}")  # always fullmatch: `$` lets "\n" through
#: The longest ``weight_version`` a receiver publishes (it is echoed in logs and answers).
MAX_VERSION_CHARS = 256


def new_round_id() -> str:
    return secrets.token_hex(16)


def check_round_id(value: object, *, field: str = "round_id") -> str | None:
    """``value`` if it is ``None`` or a well-formed id, else a :class:`PayloadError`."""
    if value is None:
        return None
    if not isinstance(value, str) or not ROUND_ID_RE.fullmatch(value):
        shown = f"a {type(value).__name__}" if not isinstance(value, str) else "a malformed id"
        raise PayloadError(f"{field}: expected {ROUND_ID_RE.pattern}, got {shown}")
    return value


def check_weight_version(value: object) -> str | None:
    """``value`` if ``None`` or a short enough string, else a :class:`PayloadError`."""
    if value is not None and not isinstance(value, str):
        raise PayloadError(f"weight_version: expected a string or null, got {value!r:.60}")
    if value is not None and len(value) > MAX_VERSION_CHARS:
        raise PayloadError(
            f"weight_version: {len(value)} characters, over the limit of {MAX_VERSION_CHARS}"
        )
    return value


def check_required(call: str, round_id: str | None, required: bool) -> None:
    """Refuse an id-less ``call`` on a receiver that requires owned rounds (a 409)."""
    if required and round_id is None:
        raise ProtocolStateError(
            f"{call}: refused, this receiver requires a round id (require_round_id) and the "
            "call carries none (vLLM-style clients send none; wtcore's clients always do); "
            "nothing was applied"
        )


def stamp_round(
    update_info: Any,
    round_id: str | None,
    *,
    staged: bool = False,
    marks: dict[str, Any] | None = None,
) -> Any:
    """``update_info`` (a dict or list of them) stamped with :data:`ROUND_KEY`, for a staged
    round :data:`STAGED_KEY`, and ``marks`` (a source's own keys, such as an adapter round's)."""
    extra: dict[str, Any] = {} if round_id is None else {ROUND_KEY: round_id}
    if staged:
        extra[STAGED_KEY] = True
    extra.update(marks or {})
    if not extra:
        return update_info
    if isinstance(update_info, list):
        return [{**e, **extra} if isinstance(e, dict) else e for e in update_info]
    return {**update_info, **extra} if isinstance(update_info, dict) else update_info


def round_stamp(update_info: Any) -> str | None:
    """The round id stamped into ``update_info`` (every entry of a list must agree), if any."""
    entries = update_info if isinstance(update_info, list) else [update_info]
    found = {
        check_round_id(e.get(ROUND_KEY), field=f"update_info.{ROUND_KEY}")
        for e in entries
        if isinstance(e, dict)
    }
    if len(found) > 1:
        raise PayloadError(f"update_info.{ROUND_KEY}: the entries name different rounds")
    return found.pop() if found else None


def drop_round(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` without the keys the client stamps: what the engine parses."""
    if ROUND_KEY not in entry and STAGED_KEY not in entry:
        return entry
    return {k: v for k, v in entry.items() if k not in (ROUND_KEY, STAGED_KEY)}


class RoundStampingClient:
    """Forwards every call; stamps the round's id into each update; opens the round in the
    background, so the engine packs its first tensors during the round trip."""

    def __init__(self, inner: Any, timeout_s: float, *, staged: bool = False) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.staged = staged
        #: Keys stamped into every update of the round besides the round's own (a round
        #: driver's, e.g. wtcore_vllm.lora's adapter mark).
        self.marks: dict[str, Any] = {}
        self._done: threading.Event | None = None
        self._error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_round(self) -> None:
        done, self._done, self._error = threading.Event(), None, None

        def start() -> None:
            try:
                self.inner.start_weight_update()
            except BaseException as e:  # raised to the thread that waits for the round
                self._error = e
            finally:
                done.set()

        self._done = done
        threading.Thread(target=start, name="start_weight_update", daemon=True).start()

    def opened(self) -> None:
        """Wait for the round :meth:`open_round` opened; a failed start raises here."""
        done = self._done
        if done is None:
            return
        if not done.wait(self.timeout_s):
            raise TransferTimeoutError(
                f"start_weight_update: no answer from the receivers within {self.timeout_s:g} s"
            )
        if self._error is not None:
            raise self._error

    def settle(self) -> None:
        """After a failure: let a start in flight end (bounded), so the abort cannot overtake it."""
        done = self._done
        if done is not None:
            done.wait(self.timeout_s)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.opened()
        round_id = getattr(self.inner, "round_id", None)
        round_id = round_id if isinstance(round_id, str) else None
        stamped = stamp_round(update_info, round_id, staged=self.staged, marks=self.marks)
        self.inner.update_weights(stamped)

    def prepare(self) -> None:
        """A staged round's barrier: returns once every receiver holds the complete round."""
        self.update_weights({PREPARE_KEY: True})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.opened()
        self.inner.finish_weight_update(weight_version)
