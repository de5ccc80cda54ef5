"""Tools for testing engines, clients and integrations: ``pip install wtcore[testing]``.

The contract suites every engine passes are in :mod:`wtcore.testing.contract`,
:mod:`~wtcore.testing.delta` and :mod:`~wtcore.testing.sharded_contract` (they need pytest);
here are the helpers they and the engines' own tests share: models and sources
(:mod:`~wtcore.testing.sources`), receivers in child processes over JSON pipes
(:mod:`~wtcore.testing.pipes`), ranks and ports (:mod:`~wtcore.testing.net`), bounded waits.
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
