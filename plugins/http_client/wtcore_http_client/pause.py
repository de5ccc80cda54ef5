"""vLLM's ``POST /pause?mode=...`` modes, checked the same way by the client and the receiver."""

from __future__ import annotations

from wtcore.errors import PayloadError

__all__ = ["PAUSE_MODES", "check_pause_mode"]

#: Abort in-flight requests, wait for them to finish, or keep them paused mid-generation.
PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: str, field: str = "mode") -> str:
    if mode not in PAUSE_MODES:
        raise PayloadError(f"{field}: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode
