"""Turn what ``ray.get`` raises into the core's one-line-per-receiver failure: the actor's
original error unwrapped from ``RayTaskError``, a dead actor's message folded onto one line."""

from __future__ import annotations

import re

from wtcore.errors import ReceiverFailure
from wtcore_kit.fanout import failure_of

__all__ = ["failure_from_ray"]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]


def failure_from_ray(label: str, error: BaseException) -> ReceiverFailure:
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
