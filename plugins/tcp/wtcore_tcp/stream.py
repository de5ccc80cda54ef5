"""Deprecated: now ``wtcore_channel.stream`` (wtcore-channel; CHANGELOG, 0.2.0); goes in 0.3."""

import warnings

from wtcore_channel.stream import *  # noqa: F403
from wtcore_channel.stream import __all__  # noqa: F401

warnings.warn(
    "wtcore_tcp.stream is wtcore_channel.stream since wtcore 0.2; the old path goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)
