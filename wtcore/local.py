"""The 0.1.0 path of :mod:`wtcore_kit.inline` (``Local*`` is ``Inline*``), forwarded with a
warning until 0.3."""

from wtcore._deprecated import moved

_PARTS = ("InitInfo", "TrainerEngine", "TrainerInitInfo", "UpdateInfo", "WorkerEngine")
__getattr__ = moved(
    __name__, "wtcore_kit.inline", renamed={f"Local{p}": f"Inline{p}" for p in _PARTS}
)
