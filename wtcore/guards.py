"""Deprecated: renamed ``wtcore.finite``, the finite check (CHANGELOG, 0.2.0); goes in 0.3."""

from wtcore._moved import moved

__all__ = ["FiniteCheckSink", "is_all_finite"]  # noqa: F822 (forwarded by __getattr__)
__getattr__ = moved(__name__, "wtcore.finite")
