"""The 0.1.0 path of :mod:`wtcore_bench.netns`, forwarded with a warning until 0.3."""

from wtcore._deprecated import moved

__getattr__ = moved(__name__, "wtcore_bench.netns", "pip install wtcore-bench")
