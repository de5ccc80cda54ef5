"""Deprecated: moved to ``wtcore_bench.serve`` (CHANGELOG, 0.2.0); this alias goes in 0.3.

Starting ``wtcore serve`` as a child process is tooling (the bench's and the tests'), not part
of the HTTP control plane.
"""

from wtcore._moved import moved

__getattr__ = moved(__name__, "wtcore_bench.serve", "pip install wtcore-bench")
