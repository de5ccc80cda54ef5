"""Deprecated: now the kit's ``wtcore.pipeline`` (CHANGELOG, 0.2.0); this alias goes in 0.3."""

import warnings

from wtcore.pipeline import *  # noqa: F403
from wtcore.pipeline import __all__  # noqa: F401

warnings.warn(
    "wtcore_nccl.pipeline is wtcore.pipeline since wtcore 0.2; the old path goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)
