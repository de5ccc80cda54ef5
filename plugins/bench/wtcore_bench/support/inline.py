"""``wtcore bench --backend inline``: the built-in engine's bench API.

``inline`` has no rendezvous, so the default :class:`~wtcore_bench.api.EngineBench` init info
(rank 0 plus the buffer size) is all it takes, and only the generic baselines apply.
"""

from __future__ import annotations

from wtcore_bench.api import EngineBench

__all__ = ["BENCH"]

#: ``engine.inline`` in ``wtcore.bench``.
BENCH = EngineBench(buffer_option="packed_buffer_size_bytes")
