"""The trainer's client for vLLM servers whose workers are sharded receivers (TP > 1).

A vLLM server with ``tensor_parallel_size=N`` is N receivers behind one URL, and a sharded round
plans for each one's layout; so ``weight_info()`` answers one entry per worker, joining the
server's answer with each worker's report over ``POST /collective_rpc``
(:data:`WORKER_INFO_METHOD`, added by wtcore-vllm's worker extension).
"""

from __future__ import annotations

from typing import Any

from wtcore.errors import PayloadError
from wtcore.sharded.layout import is_int
from wtcore.stats import ROUND_TIMES
from wtcore_http_client.client import HTTPWeightSyncClient

__all__ = ["WORKER_INFO_METHOD", "VLLMWeightSyncClient", "worker_reports"]

#: Spelled in wtcore-vllm too (neither imports the other); a test checks they agree.
WORKER_INFO_METHOD = "wtcore_weight_info"

_REQUIRED = {"rank", "world_size", "layout"}
_OPTIONAL = {"round_bytes", "layout_error", *ROUND_TIMES}
#: The most workers one server may report.
MAX_WORKERS = 4096


def worker_reports(answer: object, *, where: str) -> list[dict[str, Any]]:
    """The workers' reports in a ``/collective_rpc`` answer, checked, in rank order."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or not 0 < len(results) <= MAX_WORKERS:
        raise PayloadError(f"{where}.results: expected a list of 1 to {MAX_WORKERS} reports")
    out: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        ok = isinstance(r, dict) and _REQUIRED <= set(r) <= _REQUIRED | _OPTIONAL
        ok = ok and all(_seconds(r.get(k)) for k in ROUND_TIMES)
        if not ok or not is_int(r["rank"]) or not is_int(r["world_size"]):
            raise PayloadError(
                f"{where}.results[{i}]: expected rank, world_size and layout (and optionally "
                f"{', '.join(sorted(_OPTIONAL))}), got {r!r:.200}"
            )
        out.append(r)
    out.sort(key=lambda r: int(r["rank"]))
    ranks = [r["rank"] for r in out]
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise PayloadError(f"{where}.results: worker ranks {ranks} are not consecutive")
    return out


def _seconds(v: object) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e9)


class VLLMWeightSyncClient(HTTPWeightSyncClient):
    """:class:`~wtcore_http_client.HTTPWeightSyncClient` with one ``weight_info()`` entry per
    vLLM worker."""

    def weight_info(self) -> list[dict[str, Any]]:
        """Per worker, server by server in ``base_urls`` order and by rank within each: the
        server's ``/weight_info`` with the worker's ``rank``, ``world_size`` and ``layout``."""
        servers = super().weight_info()
        workers = self._each(WORKER_INFO_METHOD)
        return [{**info, **w} for info, ws in zip(servers, workers, strict=True) for w in ws]

    def _call(self, url: str, call: str, *args: Any, round_id: str | None = None) -> Any:
        if call == WORKER_INFO_METHOD:
            body = {"method": WORKER_INFO_METHOD, "timeout": self.timeout_s}
            answer = self._request(url, "POST", "/collective_rpc", body)
            return worker_reports(answer, where=f"POST {url}/collective_rpc")
        return super()._call(url, call, *args, round_id=round_id)
