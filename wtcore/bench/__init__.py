"""``wtcore bench``: the main job end to end, verified bit for bit, measured against limits.

Receivers are started by the bench itself: in this process for ``--client inproc``, and by a
client plugin's ``wtcore_launch_receivers`` hook otherwise (``wtcore serve`` processes for
``http``, ``WeightSyncActor`` actors for ``ray``). Every round is verified with digests
computed on both sides; any mismatch makes the run fail.
"""

from __future__ import annotations

from wtcore.bench.fleet import ModelSpec, ReceiverFleet
from wtcore.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "ModelSpec", "ReceiverFleet", "run_bench"]
