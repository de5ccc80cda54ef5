"""``http``: a :class:`~wtcore.WeightSyncClient` that speaks vLLM's RL HTTP routes.

The same trainer code drives a vLLM server (started with its RL routes enabled) or any process
running :mod:`wtcore_http_client.server`. The request bodies are exactly those of DESIGN §4.

Several base URLs (data-parallel replicas) are called concurrently through
:func:`wtcore.fanout.fan_out`: a call returns when every replica has answered, and a failure
raises one :class:`~wtcore.errors.ReceiverError` naming each failing URL, its HTTP status and
the server's message. No call is ever retried: the control calls are not idempotent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import requests
from requests.adapters import HTTPAdapter

from wtcore.errors import PayloadError, ReceiverError, TransferTimeoutError
from wtcore.fanout import fan_out
from wtcore_http_client.errors import HTTPConnectionError, HTTPStatusError, ReceiverTimeoutError
from wtcore_http_client.pause import PAUSE_MODES, check_pause_mode

__all__ = ["DEFAULT_TIMEOUT_S", "PAUSE_MODES", "HTTPWeightSyncClient"]

T = TypeVar("T")

#: Generous by default: ``init_weight_transfer_engine`` and ``update_weights`` block on the
#: receiver until the trainer has joined the rendezvous or finished the broadcast.
DEFAULT_TIMEOUT_S = 300.0
#: Extra time for the fan-out deadline, so that requests' own timeout fires first with the URL.
_GRACE_S = 2.0


def _normalize(base_urls: str | Sequence[str]) -> list[str]:
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise ValueError("base_urls: expected at least one URL, got none")
    out: list[str] = []
    for i, url in enumerate(urls):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"base_urls[{i}]: expected an http:// or https:// URL, got {url!r}")
        url = url.rstrip("/")
        if url in out:
            raise ValueError(f"base_urls[{i}]: {url!r} is listed twice")
        out.append(url)
    return out


class HTTPWeightSyncClient:
    """Blocking fan-out client over one or more receivers' base URLs.

    Args:
        base_urls: one URL or a list (one per replica), e.g. ``"http://10.0.0.2:8000"``.
        timeout_s: the most a call may take, per call, for all replicas together.
        connect_timeout_s: the most a TCP connect may take (default: ``min(10, timeout_s)``).
        api_key: sent as ``Authorization: Bearer <api_key>`` when set.
        verify: TLS verification, as in requests (``False`` or a CA bundle path).

    One :class:`requests.Session` serves the whole client, so connections are reused. The
    fan-out threads share it: its urllib3 pools are thread-safe, and the adapter keeps enough
    connections per host that concurrent calls to one replica (an ``update_weights`` blocking in
    a broadcast while ``weight_info`` polls) never wait for each other.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
        api_key: str | None = None,
        verify: bool | str = True,
    ) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        self.base_urls = _normalize(base_urls)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(
            connect_timeout_s if connect_timeout_s is not None else min(10.0, self.timeout_s)
        )
        self.verify = verify
        self._session = requests.Session()
        adapter = HTTPAdapter(
            pool_connections=max(10, len(self.base_urls)), pool_maxsize=8, max_retries=0
        )
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session.headers["Accept"] = "application/json"
        if api_key is not None:
            if not isinstance(api_key, str) or not api_key:
                raise ValueError("api_key: expected a non-empty string")
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        return f"HTTPWeightSyncClient({self.base_urls!r}, timeout_s={self.timeout_s:g})"

    # ------------------------------------------------------------------ plumbing
    def _request(
        self,
        base_url: str,
        method: str,
        route: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call; returns the decoded JSON answer or raises a named error."""
        where = f"{method} {route}"
        data = None
        headers = {}
        if body is not None:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        try:
            r = self._session.request(
                method,
                base_url + route,
                data=data,
                params=params,
                headers=headers,
                timeout=(self.connect_timeout_s, self.timeout_s),
                verify=self.verify,
            )
        except requests.Timeout as e:
            raise TransferTimeoutError(
                f"{where}: no answer within {self.timeout_s:g} s ({type(e).__name__})"
            ) from e
        except requests.RequestException as e:
            raise HTTPConnectionError(f"{where}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            message, error_type = _server_message(r)
            raise HTTPStatusError(r.status_code, where, message, error_type)
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError as e:
            raise HTTPStatusError(
                r.status_code, where, f"answer is not JSON: {r.text[:200]!r}"
            ) from e

    def _each(
        self,
        call: str,
        fn: Callable[[str], T],
    ) -> list[T]:
        """``fn(url)`` for every base URL, concurrently; one error names every failure."""
        targets = [(url, lambda url=url: fn(url)) for url in self.base_urls]
        try:
            return fan_out(call, targets, timeout_s=self.timeout_s + _GRACE_S)
        except ReceiverError as e:
            if e.timed_out:
                raise ReceiverTimeoutError(e.call, e.failures, e.total) from None
            raise

    def _post(self, call: str, body: dict[str, Any] | None = None, **kw: Any) -> list[Any]:
        return self._each(call, lambda url: self._request(url, "POST", f"/{call}", body, **kw))

    def _get(self, call: str) -> list[Any]:
        return self._each(call, lambda url: self._request(url, "GET", f"/{call}"))

    # ------------------------------------------------------------------ the protocol (§4)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``POST /init_weight_transfer_engine {"init_info": {...}}`` on every replica."""
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``POST /start_weight_update`` with no body."""
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``POST /update_weights {"update_info": {...} | [{...}, ...]}``."""
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``, with ``{"weight_version": ...}`` when one is given."""
        body = None if weight_version is None else {"weight_version": weight_version}
        self._post("finish_weight_update", body)

    # ------------------------------------------------------------------ extras
    def weight_info(self) -> list[dict[str, Any]]:
        """``GET /weight_info`` of every replica, in ``base_urls`` order."""
        return self._get("weight_info")

    def world_sizes(self) -> list[int]:
        """``GET /get_world_size`` of every replica, in ``base_urls`` order."""
        out = []
        for url, answer in zip(self.base_urls, self._get("get_world_size"), strict=True):
            size = answer.get("world_size") if isinstance(answer, dict) else None
            if not isinstance(size, int) or isinstance(size, bool):
                raise PayloadError(f"{url}/get_world_size: expected a world_size, got {answer!r}")
            out.append(size)
        return out

    def get_world_size(self) -> int:
        """The inference world size, which every replica must report alike."""
        sizes = self.world_sizes()
        if len(set(sizes)) != 1:
            listed = ", ".join(f"{u}: {s}" for u, s in zip(self.base_urls, sizes, strict=True))
            raise PayloadError(f"get_world_size: the replicas disagree ({listed})")
        return sizes[0]

    def pause(self, mode: str = "abort", *, clear_cache: bool | None = None) -> None:
        """``POST /pause?mode=...`` (vLLM): stop generating while weights change."""
        params = {"mode": check_pause_mode(mode)}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        self._post("pause", params=params)

    def resume(self) -> None:
        """``POST /resume`` (vLLM)."""
        self._post("resume")

    def is_paused(self) -> list[bool]:
        """``GET /is_paused`` of every replica."""
        return [bool(a.get("is_paused")) for a in self._get("is_paused")]

    def checksums(self) -> list[dict[str, str]]:
        """``POST /weight_checksums``: ``{name: digest}`` of what each replica holds."""
        return [a["checksums"] for a in self._post("weight_checksums")]

    def health(self) -> list[dict[str, Any]]:
        """``GET /health`` of every replica."""
        return self._get("health")

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> HTTPWeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    bench_launcher: ClassVar[str] = "wtcore_http_client.bench:HTTPFleet"  # wtcore bench


def _server_message(r: requests.Response) -> tuple[str, str | None]:
    """The server's message: ``{"error": ...}`` (wtcore, vLLM) or ``{"detail": ...}`` (FastAPI)."""
    try:
        body = r.json()
    except ValueError:
        text = r.text.strip()
        return (text[:500] or r.reason or "no message"), None
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):  # OpenAI-style {"error": {"message": ..., "type": ...}}
            kind = err.get("type")
            return str(err.get("message", err)), kind if isinstance(kind, str) else None
        if err is not None:
            kind = body.get("error_type")
            return str(err), kind if isinstance(kind, str) else None
    return json.dumps(body)[:500], None
