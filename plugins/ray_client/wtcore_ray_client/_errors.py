"""Turn what ``ray.get`` raises into the core's one failure format.

An exception raised inside an actor method reaches the caller wrapped in a
``RayTaskError(<cls>)`` whose message is a remote traceback; the trainer wants the original
error (``PayloadError: ... unknown parameter name``), so the cause is unwrapped. A dead actor
raises ``ActorDiedError`` with a multi-line message; it is folded onto one line so that
:class:`wtcore.ReceiverError` stays one line per receiver.
"""

from __future__ import annotations

from wtcore.errors import ReceiverFailure
from wtcore.fanout import failure_of

__all__ = ["failure_from_ray"]


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def failure_from_ray(label: str, error: BaseException) -> ReceiverFailure:
    """A :class:`ReceiverFailure` for ``error`` as raised by ``ray.get`` for ``label``."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause
        if isinstance(cause, BaseException) and not isinstance(cause, RayTaskError):
            return failure_of(label, cause)
    if isinstance(error, RayActorError):
        f = failure_of(label, error)
        return ReceiverFailure(f.receiver, _one_line(f.message), f.status, f.error_type)
    return failure_of(label, error)
