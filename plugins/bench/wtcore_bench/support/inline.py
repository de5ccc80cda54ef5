"""``wtcore bench --backend inline``: no rendezvous, so the default init info serves."""

from __future__ import annotations

from wtcore_bench.api import EngineBench

__all__ = ["BENCH"]

#: ``engine.inline`` in ``wtcore.bench``.
BENCH = EngineBench(buffer_option="packed_buffer_size_bytes")
