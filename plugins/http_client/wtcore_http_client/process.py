"""0.1.0's ``wtcore_http_client.process``, now :mod:`wtcore_bench.serve` (starting ``wtcore
serve`` as a child process is tooling, not the HTTP control plane): forwarded with a warning
until 0.3."""

from wtcore._deprecated import moved

__getattr__ = moved(__name__, "wtcore_bench.serve", "pip install wtcore-bench")
