"""The exception hierarchy of wtcore.

Every error a user can meet derives from :class:`WtcoreError`, and each one *also* derives
from the builtin that best describes it (``ValueError`` for bad input, ``TypeError`` for an
object of the wrong kind, ``TimeoutError`` for an expired wait, ...). That lets callers write
``except TimeoutError`` or ``except ValueError`` without knowing wtcore, and lets the CLI print
any of them as one line.

The family is deliberately small::

    WtcoreError
    +-- PayloadError (ValueError)            bad input; nothing was applied          HTTP 400
    |   +-- WrongTypeError (TypeError)       an object of the wrong kind             HTTP 400
    |   +-- UnknownNameError (KeyError)      a name that is not one of the known ones HTTP 400
    |   +-- MissingFileError                 a file named in the input does not exist HTTP 400
    |       (FileNotFoundError)
    +-- MetadataMismatchError (ValueError)   a source broke its own metadata()       HTTP 400
    +-- ProtocolStateError (RuntimeError)    a call out of order (incl. no init)     HTTP 409
    |   +-- StaleBaseError                   a delta round's base is not what we hold HTTP 409
    +-- TransferError (RuntimeError)         the data plane failed                   HTTP 500
    |   +-- VerificationError                received bytes differ from those sent   HTTP 500
    +-- TransferTimeoutError (TimeoutError)  a blocking wait ran out                 HTTP 504
    +-- ReceiverError (RuntimeError)         a fanned-out call failed on receivers
    |   +-- ReceiverTimeoutError             ... and every failure was a timeout (also a
    |                                        TransferTimeoutError)
    +-- PluginNotFoundError (LookupError)    no plugin of that name
    +-- PluginLoadError (ImportError)        a plugin failed to import

:func:`http_status` is the one mapping from a class to an HTTP status; the reference HTTP
receiver answers with it, and :func:`wtcore.fanout.failure_of` stamps it on in-process and
Ray failures too, so a condition reads the same over every transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MetadataMismatchError",
    "MissingFileError",
    "PayloadError",
    "PluginConflictError",
    "PluginLoadError",
    "PluginNotFoundError",
    "PluginTypeError",
    "ProtocolStateError",
    "ReceiverError",
    "ReceiverFailure",
    "ReceiverTimeoutError",
    "StaleBaseError",
    "TransferError",
    "TransferTimeoutError",
    "UnknownNameError",
    "VerificationError",
    "WrongTypeError",
    "WtcoreError",
    "http_status",
]


class WtcoreError(Exception):
    """Base class of every wtcore error."""


class PayloadError(WtcoreError, ValueError):
    """Bad input: a config, argument, init info or update info was malformed.

    Raised before anything is received or applied, so the caller can fix the input and retry.
    """


class WrongTypeError(PayloadError, TypeError):
    """An argument is an object of the wrong kind (a client without inspection calls, ...)."""


class UnknownNameError(PayloadError, KeyError):
    """A name that is not one of a fixed set (a stats phase, ...); the message lists the set.

    Also a ``KeyError``, which is what a lookup by name raises without wtcore.
    """

    def __str__(self) -> str:
        # KeyError quotes its argument (it is usually a key); this one is a sentence.
        return Exception.__str__(self)


class MissingFileError(PayloadError, FileNotFoundError):
    """A file named in the input (a config file, a checkpoint) does not exist.

    Also a ``FileNotFoundError``, so ``except FileNotFoundError`` and ``except OSError`` keep
    working; the message names the path.
    """


class ProtocolStateError(WtcoreError, RuntimeError):
    """A call arrived in the wrong order (start twice, update before start, no init, ...).

    An engine whose data plane is not set up (init was never called, or a failed round
    dropped it) raises this too: the fix is the same, the trainer re-initializes.
    """


class MetadataMismatchError(WtcoreError, ValueError):
    """A source yielded something other than what its ``metadata()`` promised."""


class StaleBaseError(ProtocolStateError):
    """A delta round's patches were computed against a version this receiver does not hold.

    Raised before anything of the round is applied (a new replica, one that failed a round or
    restarted, a sink that cannot take patches). The trainer answers with a full round.
    """


class TransferError(WtcoreError, RuntimeError):
    """The data plane failed (a peer died, a collective failed, a segment vanished)."""


class VerificationError(TransferError):
    """What a receiver holds differs from what the trainer sent (``send_weights(verify=True)``)."""


class TransferTimeoutError(WtcoreError, TimeoutError):
    """A blocking wait ran past its timeout. The message says what was waited for.

    The one timeout class of wtcore, whatever the transport: ``except TimeoutError`` catches
    it in process, over HTTP and over Ray alike.
    """


class PluginNotFoundError(WtcoreError, LookupError):
    """No plugin is registered under the requested name."""


class PluginLoadError(WtcoreError, ImportError):
    """A registered plugin failed to import; the cause is chained."""


@dataclass(frozen=True)
class ReceiverFailure:
    """One receiver's failure inside a fanned-out call.

    ``status`` is the HTTP status of the condition (the receiver's answer over HTTP, or
    :func:`http_status` of the error in process and over Ray); ``timed_out`` says whether the
    receiver failed by not answering in time.
    """

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
    """One or more receivers failed a control-plane call.

    Raised once per fanned-out call, naming every receiver that failed, so that a trainer
    never has to guess which replica is broken. Build one with :meth:`of`, which picks
    :class:`ReceiverTimeoutError` when every failure was a timeout.
    """

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
    """Every failing receiver of a fanned-out call failed by timing out.

    It is both a :class:`ReceiverError` (each receiver is named) and a
    :class:`TransferTimeoutError`, so ``except TimeoutError`` catches a stuck replica over
    every transport.
    """


#: Most specific first: the first class an error is an instance of gives its status.
_HTTP_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (PayloadError, 400),
    (MetadataMismatchError, 400),
    (PluginNotFoundError, 404),
    (ProtocolStateError, 409),
    (TransferTimeoutError, 504),
)


def http_status(error: BaseException) -> int:
    """The HTTP status a receiver answers for ``error``: 400, 404, 409, 504, else 500."""
    for cls, status in _HTTP_STATUS:
        if isinstance(error, cls):
            return status
    return 500


class PluginConflictError(WtcoreError, ValueError):
    """Two sources claim one plugin name (two distributions, or a plugin and a built-in)."""


class PluginTypeError(PluginLoadError, TypeError):
    """A registered plugin imported, but is not the kind of class its registry holds."""
