"""Turn what ``ray.get`` raises into the core's one failure format.

An exception raised inside an actor method reaches the caller wrapped in a
``RayTaskError(<cls>)`` whose message is a remote traceback; the trainer wants the original
error (``PayloadError: ... unknown parameter name``), so the cause is unwrapped. A dead actor
raises ``ActorDiedError`` with a multi-line message; it is folded onto one line (or, when the
actor's constructor failed, cut to the error's last line) so that :class:`wtcore.ReceiverError`
stays one line per receiver.
"""

from __future__ import annotations

import re

from wtcore.errors import ReceiverFailure
from wtcore_kit.fanout import failure_of

__all__ = ["failure_from_ray"]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]


def failure_from_ray(label: str, error: BaseException) -> ReceiverFailure:
    """A :class:`ReceiverFailure` for ``error`` as raised by ``ray.get`` for ``label``."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause
        if isinstance(cause, BaseException) and not isinstance(cause, RayTaskError):
            return failure_of(label, cause)
    if isinstance(error, RayActorError):
        lines = _lines(str(error))
        if error.actor_init_failed and lines:
            # The creation task's traceback ends with "ExcType: message": keep that line.
            message = f"the actor's constructor failed: {lines[-1]}"
        else:
            message = "; ".join(lines) or repr(error)
        return ReceiverFailure(label, message, error_type=type(error).__name__)
    return failure_of(label, error)
