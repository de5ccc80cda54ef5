"""Tools for testing engines, clients and integrations: ``pip install wtcore[testing]``.

* :class:`RecordingClient` records (and forwards) every control-plane call, and checks that
  each payload survives a JSON round trip.
* :mod:`wtcore.testing.sources` builds synthetic models and sources, including sources whose
  iteration disagrees with their metadata.
* :mod:`wtcore.testing.pipes` drives ``WeightSyncWorker`` s in child processes over a pipe
  (JSON only, every wait bounded): :class:`PipeClient`, :func:`pipe_fleet`, :func:`serve_worker`.
* :class:`EngineContractSuite` (in :mod:`wtcore.testing.contract`, which needs pytest) is the
  suite every engine pair subclasses.
"""

from __future__ import annotations

from wtcore.testing.net import free_port, spawned
from wtcore.testing.pipes import (
    PipeClient,
    PipeFleet,
    RemoteError,
    decode_state,
    encode_state,
    pipe_fleet,
    serve_worker,
)
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
    "PipeClient",
    "PipeFleet",
    "RecordingClient",
    "RemoteError",
    "build_module",
    "decode_state",
    "encode_state",
    "free_port",
    "mixed_dtype_state",
    "pipe_fleet",
    "serve_worker",
    "spawned",
    "synthetic_state",
    "zeros_like_state",
]
