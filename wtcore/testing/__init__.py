"""Tools for testing engines, clients and integrations: ``pip install wtcore[testing]``.

* :class:`RecordingClient` records (and forwards) every control-plane call, and checks that
  each payload survives a JSON round trip.
* :mod:`wtcore.testing.sources` builds synthetic models and sources, including sources whose
  iteration disagrees with their metadata, :class:`KillingSource` (a receiver dies mid-round)
  :func:`spec_of` / :func:`state_of_spec` (a model's shape as JSON, and back as zeros) and
  :func:`make_state`, the test models that the engines' process tests share.
* :func:`wait_until` polls for a condition, bounded, naming what it waited for.
* :func:`wtcore.testing.procs.stop_processes` stops the child processes a test or the bench
  started, always, by PID (moved here from ``wtcore.procs``: it is tooling, not protocol).
* :mod:`wtcore.testing.pipes` drives ``WeightSyncWorker`` s in child processes over a pipe
  (JSON only, every wait bounded): :class:`PipeClient`, :func:`pipe_fleet`, :func:`serve_worker`.
* :class:`EngineContractSuite` (in :mod:`wtcore.testing.contract`, which needs pytest) is the
  suite every engine pair subclasses.
"""

from __future__ import annotations

from wtcore.testing.net import free_port, on_ranks, spawned, torchrun
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
    KillingSource,
    MismatchedSource,
    build_module,
    make_state,
    mixed_dtype_state,
    spec_of,
    state_of_spec,
    synthetic_state,
    zeros_like_state,
)
from wtcore.testing.waits import wait_until

__all__ = [
    "MISMATCH_KINDS",
    "KillingSource",
    "MismatchedSource",
    "PipeClient",
    "PipeFleet",
    "RecordingClient",
    "RemoteError",
    "build_module",
    "decode_state",
    "encode_state",
    "free_port",
    "make_state",
    "mixed_dtype_state",
    "on_ranks",
    "pipe_fleet",
    "serve_worker",
    "spawned",
    "spec_of",
    "state_of_spec",
    "synthetic_state",
    "torchrun",
    "wait_until",
    "zeros_like_state",
]
