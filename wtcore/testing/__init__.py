"""Tools for testing engines, clients and integrations: ``pip install wtcore[testing]``.

* :class:`RecordingClient` records (and forwards) every control-plane call, and checks that
  each payload survives a JSON round trip.
* :mod:`wtcore.testing.sources` builds synthetic models and sources, including sources whose
  iteration disagrees with their metadata.
* :class:`EngineContractSuite` (in :mod:`wtcore.testing.contract`, which needs pytest) is the
  suite every engine pair subclasses.
"""

from __future__ import annotations

from wtcore.testing.net import free_port, spawned
from wtcore.testing.recording import RecordingClient
from wtcore.testing.sources import (
    MISMATCH_KINDS,
    MismatchedSource,
    build_module,
    mixed_dtype_state,
    synthetic_state,
    zeros_like_state,
)

__all__ = [
    "MISMATCH_KINDS",
    "MismatchedSource",
    "RecordingClient",
    "build_module",
    "free_port",
    "mixed_dtype_state",
    "spawned",
    "synthetic_state",
    "zeros_like_state",
]
