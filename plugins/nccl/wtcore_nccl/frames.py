"""Deprecated: now the kit's ``wtcore.frames`` (CHANGELOG, 0.2.0); this alias goes in 0.3."""

import warnings

from wtcore.frames import *  # noqa: F403
from wtcore.frames import __all__  # noqa: F401

warnings.warn(
    "wtcore_nccl.frames is wtcore.frames since wtcore 0.2; the old path goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)
