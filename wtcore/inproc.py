"""The 0.1.0 path of :mod:`wtcore_kit.inproc`, forwarded with a warning until 0.3."""

from wtcore._deprecated import moved

__getattr__ = moved(__name__, "wtcore_kit.inproc")
