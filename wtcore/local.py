"""Deprecated: renamed ``wtcore.inline``, ``Local*`` as ``Inline*`` (CHANGELOG 0.2.0) until 0.3."""

from wtcore._moved import moved

_PARTS = ("InitInfo", "TrainerEngine", "TrainerInitInfo", "UpdateInfo", "WorkerEngine")
__all__ = [f"Local{p}" for p in _PARTS]
__getattr__ = moved(__name__, "wtcore.inline", renamed={f"Local{p}": f"Inline{p}" for p in _PARTS})
