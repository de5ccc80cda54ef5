"""Deprecated: moved to ``wtcore_delta.receiver`` (CHANGELOG, 0.2.0); this alias goes in 0.3."""

from wtcore._moved import moved

__getattr__ = moved(__name__, "wtcore_delta.receiver", "pip install wtcore-delta")
