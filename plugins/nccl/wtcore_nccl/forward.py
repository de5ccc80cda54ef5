"""Deprecated: renamed ``wtcore_nccl.chain`` (CHANGELOG, 0.2.0); this alias goes in 0.3."""

import warnings

from wtcore_nccl.chain import *  # noqa: F403
from wtcore_nccl.chain import __all__  # noqa: F401

warnings.warn(
    "wtcore_nccl.forward is wtcore_nccl.chain since wtcore 0.2; the old path goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)
