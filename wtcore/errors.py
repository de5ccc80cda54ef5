"""The exception hierarchy of wtcore.

Every error a user can meet derives from :class:`WtcoreError`, and each one *also* derives
from the builtin that best describes it (``ValueError`` for bad input, ``TimeoutError`` for an
expired wait, ...). That lets callers write ``except ValueError`` without knowing wtcore, while
transports can map the classes onto status codes: :class:`PayloadError` is HTTP 400,
:class:`ProtocolStateError` is 409, anything else is 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MetadataMismatchError",
    "PayloadError",
    "PluginConflictError",
    "PluginLoadError",
    "PluginNotFoundError",
    "PluginTypeError",
    "ProtocolStateError",
    "ReceiverError",
    "ReceiverFailure",
    "TransferError",
    "TransferTimeoutError",
    "VerificationError",
    "WtcoreError",
]


class WtcoreError(Exception):
    """Base class of every wtcore error."""


class PayloadError(WtcoreError, ValueError):
    """A config, init info or update info was malformed. Nothing was applied."""


class ProtocolStateError(WtcoreError, RuntimeError):
    """A call arrived in the wrong order (start twice, update before start, ...)."""


class MetadataMismatchError(WtcoreError, ValueError):
    """A source yielded something other than what its ``metadata()`` promised."""


class TransferError(WtcoreError, RuntimeError):
    """The data plane failed (a peer died, a collective failed, a segment vanished)."""


class VerificationError(TransferError):
    """What a receiver holds differs from what the trainer sent (``send_weights(verify=True)``)."""


class TransferTimeoutError(WtcoreError, TimeoutError):
    """A blocking wait ran past its timeout. The message says what was waited for."""


class PluginNotFoundError(WtcoreError, LookupError):
    """No plugin is registered under the requested name."""


class PluginLoadError(WtcoreError, ImportError):
    """A registered plugin failed to import; the cause is chained."""


@dataclass(frozen=True)
class ReceiverFailure:
    """One receiver's failure inside a fanned-out call."""

    receiver: str
    message: str
    status: int | None = None
    error_type: str | None = None

    def __str__(self) -> str:
        status = f" [{self.status}]" if self.status is not None else ""
        kind = f"{self.error_type}: " if self.error_type else ""
        return f"{self.receiver}{status}: {kind}{self.message}"


class ReceiverError(WtcoreError, RuntimeError):
    """One or more receivers failed a control-plane call.

    Raised once per fanned-out call, naming every receiver that failed, so that a trainer
    never has to guess which replica is broken.
    """

    def __init__(self, call: str, failures: Sequence[ReceiverFailure], total: int) -> None:
        self.call = call
        self.failures = list(failures)
        self.total = total
        lines = "\n".join(f"  - {f}" for f in self.failures)
        super().__init__(f"{call} failed on {len(self.failures)} of {total} receiver(s):\n{lines}")

    @property
    def timed_out(self) -> bool:
        """True if every failure was a timeout."""
        return all(f.error_type == "TransferTimeoutError" for f in self.failures)


class PluginConflictError(WtcoreError, ValueError):
    """Two sources claim one plugin name (two distributions, or a plugin and a built-in)."""


class PluginTypeError(PluginLoadError, TypeError):
    """A registered plugin imported, but is not the kind of class its registry holds."""
