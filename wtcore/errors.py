"""The exception hierarchy of wtcore.

Every error a user can meet derives from :class:`WtcoreError`, and each one *also* derives
from the builtin that best describes it (``ValueError`` for bad input, ``TimeoutError`` for an
expired wait, ``ImportError`` for a plugin that cannot be used, ...). That lets callers write
``except TimeoutError`` or ``except ValueError`` without knowing wtcore, and lets the CLI print
any of them as one line.

The family is deliberately small::

    WtcoreError
    +-- PayloadError (ValueError)            bad input, the field named (a wrong type,  HTTP 400
    |                                        an unknown name, a missing file, a source
    |                                        that broke its metadata()), refused unused
    +-- ProtocolStateError (RuntimeError)    a call out of order (incl. no init)        HTTP 409
    +-- TransferError (RuntimeError)         the data plane failed                      HTTP 500
    |   +-- VerificationError                received bytes differ from those sent      HTTP 500
    +-- TransferTimeoutError (TimeoutError)  a blocking wait ran out                    HTTP 504
    +-- ReceiverError (RuntimeError)         a fanned-out call failed on receivers      HTTP 500
    |   +-- ReceiverTimeoutError             ... and every failure was a timeout (also  HTTP 504
    |                                        a TransferTimeoutError)
    +-- PluginLoadError (ImportError,        a plugin cannot be used; ``reason`` says   HTTP 500,
    |   LookupError)                         why (not found, a conflict, ...)           404 if not
    |                                                                                   found
    +-- RemoteError (RuntimeError)           a peer's error, from its ErrorRecord       its status

A distribution raises its own conditions as a subclass of one of these. :func:`http_status`
maps a class to its status and :class:`ErrorRecord` is an error as JSON, so a condition reads
the same over every transport (docs/architecture.md, "Errors").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

__all__ = [
    "MAX_MESSAGE_CHARS",
    "ErrorRecord",
    "PayloadError",
    "PluginLoadError",
    "ProtocolStateError",
    "ReceiverError",
    "ReceiverFailure",
    "ReceiverTimeoutError",
    "RemoteError",
    "TransferError",
    "TransferTimeoutError",
    "VerificationError",
    "WtcoreError",
    "http_status",
]


class WtcoreError(Exception):
    """Base class of every wtcore error."""


class PayloadError(WtcoreError, ValueError):
    """Bad input: a config, argument, init info or update info was malformed.

    The message names the field: an object of the wrong kind, a name not among the known ones
    (it lists them), a file that does not exist, a source that yielded other than its
    ``metadata()`` promised. Raised before anything of it is applied, so the caller can fix
    the input and retry.
    """


class ProtocolStateError(WtcoreError, RuntimeError):
    """A call arrived in the wrong order (start twice, update before start, no init, ...)."""


class TransferError(WtcoreError, RuntimeError):
    """The data plane failed (a peer died, a collective failed, a segment vanished)."""


class VerificationError(TransferError):
    """What a receiver holds differs from what the trainer sent (``send_weights(verify=True)``)."""


class TransferTimeoutError(WtcoreError, TimeoutError):
    """A blocking wait ran past its timeout; the message says what was waited for."""


class PluginLoadError(WtcoreError, ImportError, LookupError):
    """A plugin cannot be used; :attr:`reason` says why and the message what to do.

    ``"not-found"``: no plugin of that name (HTTP 404; the message lists what is installed);
    ``"conflict"``: two sources claim the name (two distributions, or a plugin and a
    built-in); ``"wrong-type"``: not the kind of class its registry holds; ``"api"``: an
    engine lacks a method the current engine API requires (written for an older wtcore; the
    message names the upgrade notes); ``"import"``: it failed to import (the cause is chained).
    A peer's (a :class:`RemoteError`) says ``"import"``: only its status tells a 404.
    """

    def __init__(
        self,
        message: str,
        reason: Literal["not-found", "conflict", "wrong-type", "api", "import"] = "import",
    ) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ReceiverFailure:
    """One receiver's failure inside a fanned-out call (``status``: its HTTP status)."""

    receiver: str
    message: str
    status: int | None = None
    error_type: str | None = None
    timed_out: bool = False

    def __str__(self) -> str:
        status = f" [{self.status}]" if self.status is not None else ""
        kind = f"{self.error_type}: " if self.error_type else ""
        return f"{self.receiver}{status}: {kind}{self.message}"


class ReceiverError(WtcoreError, RuntimeError):
    """One or more receivers failed a control-plane call; names every one that failed."""

    def __init__(self, call: str, failures: Sequence[ReceiverFailure], total: int) -> None:
        self.call = call
        self.failures = list(failures)
        self.total = total
        lines = "\n".join(f"  - {f}" for f in self.failures)
        super().__init__(f"{call} failed on {len(self.failures)} of {total} receiver(s):\n{lines}")

    def __reduce__(self) -> tuple[type[ReceiverError], tuple[str, list[ReceiverFailure], int]]:
        return (type(self), (self.call, self.failures, self.total))

    @classmethod
    def of(cls, call: str, failures: Sequence[ReceiverFailure], total: int) -> ReceiverError:
        """The error for these failures: a :class:`ReceiverTimeoutError` if all timed out."""
        if failures and all(f.timed_out for f in failures):
            return ReceiverTimeoutError(call, failures, total)
        return ReceiverError(call, failures, total)

    @property
    def timed_out(self) -> bool:
        """True if every failure was a timeout."""
        return bool(self.failures) and all(f.timed_out for f in self.failures)


class ReceiverTimeoutError(ReceiverError, TransferTimeoutError):
    """Every failing receiver timed out: also a :class:`TransferTimeoutError`, so
    ``except TimeoutError`` catches a stuck replica over every transport."""


#: Most specific first: the first class an error is an instance of gives its status.
_HTTP_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (PayloadError, 400),
    (ProtocolStateError, 409),
    (TransferTimeoutError, 504),
)


def http_status(error: BaseException) -> int:
    """The HTTP status for ``error``: 400, 404, 409, 504, else 500 (a peer's keeps its own)."""
    record = getattr(error, "record", None)
    if isinstance(record, ErrorRecord):
        return record.status
    if isinstance(error, PluginLoadError) and error.reason == "not-found":
        return 404
    for cls, status in _HTTP_STATUS:
        if isinstance(error, cls):
            return status
    return 500


# ---------------------------------------------------------------------- errors as JSON
#: Most characters of an :class:`ErrorRecord`'s message. A longer one is cut (and marked) when
#: a record is made here, and refused when one arrives. 8192 characters of ASCII keep an HTTP
#: error body well inside the HTTP client's 64 KiB limit on error bodies.
MAX_MESSAGE_CHARS = 8192
#: What a type name may be: a class name, dotted (``module.Class``) or Ray's wrapped form
#: (``RayTaskError(PayloadError)``), at most 128 characters.
_TYPE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.()]{0,127}")
_CUT = " ... (cut)"


def _kind(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:57] + '...' if len(text) > 60 else text}"


def _type_name(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise PayloadError(f"{field}: expected a string, got {_kind(value)}")
    if not _TYPE_NAME.fullmatch(value):
        raise PayloadError(
            f"{field}: expected a class name (letters, digits, '_', '.', '(', ')'; at most 128 "
            f"characters), got {value[:60]!r}"
        )
    return value


def _error_status(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PayloadError(f"{field}: expected an integer, got {_kind(value)}")
    if not 400 <= value <= 599:
        raise PayloadError(f"{field}: expected an HTTP error status (400 to 599), got {value}")
    return int(value)  # an http.HTTPStatus becomes a plain int


@dataclass(frozen=True)
class ErrorRecord:
    """An error as plain data: its class name, its message and its HTTP status.

    The one form of an error on every control plane (HTTP error bodies, the test pipes, the
    fan-out's report), never a pickle: one set of keys, one size limit, one check of what a
    peer sent (:meth:`from_json`). A message over :data:`MAX_MESSAGE_CHARS` is cut when made
    here and refused when it arrives.
    """

    type: str
    message: str
    status: int

    def __post_init__(self) -> None:
        _type_name(self.type, "ErrorRecord.type")
        if not isinstance(self.message, str):
            raise PayloadError(f"ErrorRecord.message: expected a string, got {_kind(self.message)}")
        if len(self.message) > MAX_MESSAGE_CHARS:
            cut = self.message[: MAX_MESSAGE_CHARS - len(_CUT)] + _CUT
            object.__setattr__(self, "message", cut)
        object.__setattr__(self, "status", _error_status(self.status, "ErrorRecord.status"))

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorRecord:
        """The record of ``exc``: the record it carries (a peer's error, a receiver's HTTP
        answer), else its class name, its text and :func:`http_status`."""
        record = getattr(exc, "record", None)
        if isinstance(record, ErrorRecord):
            return record
        name = type(exc).__name__
        if not _TYPE_NAME.fullmatch(name):  # a class made with type() may be named anything
            name = re.sub(r"[^A-Za-z0-9_.()]", "_", name)
            name = name[:128] if _TYPE_NAME.fullmatch(name[:128]) else f"_{name[:127]}"
        try:
            message = str(exc)
        except Exception:  # a broken __str__ must not hide the error itself
            message = f"<a {name} whose str() failed>"
        return cls(name, message, http_status(exc))

    def to_json(self) -> dict[str, Any]:
        """``{"error": message, "error_type": type, "status": status}``: plain JSON."""
        return {"error": self.message, "error_type": self.type, "status": self.status}

    @classmethod
    def from_json(cls, obj: object) -> ErrorRecord:
        """The record in ``obj``, a peer's JSON object, checked as hostile input (a bad value
        is a :class:`PayloadError` naming the key; other keys are the envelope's, unread)."""
        if not isinstance(obj, Mapping):
            raise PayloadError(f"error_record: expected a JSON object, got {_kind(obj)}")
        for key in ("error", "error_type", "status"):
            if key not in obj:
                raise PayloadError(f"error_record.{key}: missing required field")
        message = obj["error"]
        if not isinstance(message, str):
            raise PayloadError(f"error_record.error: expected a string, got {_kind(message)}")
        if len(message) > MAX_MESSAGE_CHARS:
            raise PayloadError(
                f"error_record.error: {len(message)} characters, over the limit of "
                f"{MAX_MESSAGE_CHARS}"
            )
        return cls(
            _type_name(obj["error_type"], "error_record.error_type"),
            message,
            _error_status(obj["status"], "error_record.status"),
        )

    def to_exception(self, where: str = "") -> RemoteError:
        """This record as a :class:`RemoteError` (``where`` names the call).

        When :attr:`type` names one of wtcore's classes it is also an instance of that class,
        so ``except PayloadError`` catches a peer's error as a local one; any other name gives a
        plain :class:`RemoteError` (a peer's name is never looked up elsewhere).
        """
        return _REMOTE_CLASSES.get(self.type, RemoteError)(self, where)


class RemoteError(WtcoreError, RuntimeError):
    """An error a peer reported as an :class:`ErrorRecord`; reads ``where: Type: message``."""

    def __init__(self, record: ErrorRecord, where: str = "") -> None:
        head = f"{where}: " if where else ""
        super().__init__(f"{head}{record.type}: {record.message}")
        self.record = record
        self.where = where
        self.status = record.status

    def __reduce__(
        self,
    ) -> tuple[Callable[[ErrorRecord, str], RemoteError], tuple[ErrorRecord, str]]:
        return (_remote_error, (self.record, self.where))


def _remote_error(record: ErrorRecord, where: str) -> RemoteError:
    """Unpickle a :class:`RemoteError` (its class is made here, not found by name)."""
    return record.to_exception(where)


def _remote_classes() -> dict[str, type[RemoteError]]:
    """One :class:`RemoteError` subclass per wtcore error class but :class:`ReceiverError`'s
    (built from failures, not a message: a peer's arrives as a plain :class:`RemoteError`)."""
    out: dict[str, type[RemoteError]] = {"RemoteError": RemoteError}
    for name in __all__:
        local = globals()[name]
        if not (isinstance(local, type) and issubclass(local, WtcoreError)) or issubclass(
            local, (ReceiverError, RemoteError)
        ):
            continue
        out[name] = cast(
            "type[RemoteError]", type(name, (RemoteError, local), {"__module__": __name__})
        )
    return out


#: The classes :meth:`ErrorRecord.to_exception` makes: a fixed set, never a peer's name.
_REMOTE_CLASSES = _remote_classes()

#: 0.1.0's names of classes merged in 0.2.0, kept until 0.3 (not in ``__all__``).
WrongTypeError = MetadataMismatchError = PayloadError
PluginNotFoundError = PluginLoadError
