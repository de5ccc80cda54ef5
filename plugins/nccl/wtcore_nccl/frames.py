"""Deprecated: now ``wtcore_channel.frames`` (wtcore-channel; CHANGELOG, 0.2.0); goes in 0.3."""

import warnings

from wtcore_channel.frames import *  # noqa: F403
from wtcore_channel.frames import __all__  # noqa: F401

warnings.warn(
    "wtcore_nccl.frames is wtcore_channel.frames since wtcore 0.2; the old path goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)
