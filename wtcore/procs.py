"""The 0.1.0 path of :mod:`wtcore.testing.procs`, forwarded with a warning until 0.3."""

from wtcore._deprecated import moved

__getattr__ = moved(__name__, "wtcore.testing.procs")
