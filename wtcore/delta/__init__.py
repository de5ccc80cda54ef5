"""Deprecated: delta rounds moved to the ``wtcore-delta`` distribution, package ``wtcore_delta``
(CHANGELOG, 0.2.0); this alias goes in 0.3."""

from wtcore._moved import moved

__getattr__ = moved(__name__, "wtcore_delta", "pip install wtcore-delta")
