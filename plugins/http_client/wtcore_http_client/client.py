"""``http``: a :class:`~wtcore.WeightSyncClient` that speaks vLLM's RL HTTP routes.

Request bodies are exactly vLLM's, so one trainer drives a vLLM server or a wtcore receiver.
Only idempotent calls are retried (once, on a fresh connection), and answers are read bounded
so a hostile receiver cannot make the trainer allocate. See docs/http.md, "The client".
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import ErrorRecord, PayloadError, TransferTimeoutError
from wtcore.rounds import ROUND_HEADER, new_round_id
from wtcore_http_client.errors import HTTPConnectionError, HTTPStatusError
from wtcore_http_client.pause import PAUSE_MODES, check_pause_mode
from wtcore_kit.fanout import FanOutClient, PerReceiver, Target, receiver_args

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "IDEMPOTENT_CALLS",
    "MAX_ANSWER_BYTES",
    "MAX_ERROR_BYTES",
    "PAUSE_MODES",
    "HTTPWeightSyncClient",
]

log = logging.getLogger("wtcore_http_client.client")

#: Extra time for the fan-out deadline, so that requests' own timeout fires first with the URL.
_GRACE_S = 2.0
#: The most bytes read of a successful answer (checksums of a large model are a few MiB).
MAX_ANSWER_BYTES = 64 << 20
#: The most bytes read of an error answer: enough for any message worth showing.
MAX_ERROR_BYTES = 64 << 10
#: Calls that change nothing, or set a state again to the same value: safe to send twice.
IDEMPOTENT_CALLS = frozenset(
    {"pause", "resume", "weight_info", "health", "is_paused", "get_world_size", "checksums"}
)
_READ_CHUNK = 64 << 10


def _normalize(base_urls: str | Sequence[str]) -> list[str]:
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise PayloadError("base_urls: expected at least one URL, got none")
    out: list[str] = []
    for i, url in enumerate(urls):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise PayloadError(f"base_urls[{i}]: expected an http:// or https:// URL, got {url!r}")
        url = url.rstrip("/")
        if url in out:
            raise PayloadError(f"base_urls[{i}]: {url!r} is listed twice")
        out.append(url)
    return out


class HTTPWeightSyncClient(FanOutClient):
    """Both client protocols over one or more receivers' base URLs (one per replica).

    ``timeout_s`` bounds each call for all replicas together; ``api_key`` is sent as a bearer
    token; ``verify`` is requests' TLS verification. One session, shared by the fan-out threads,
    keeps several connections per replica so that concurrent calls to one never wait.
    ``commit_pause``: vLLM's pause mode around each finish (``None``: none), so a staged round's
    commit and its version label land between the same two engine steps, and ``wait`` or
    ``abort`` settles the requests in flight first (docs/vllm.md, "Staged rounds").
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
        api_key: str | None = None,
        verify: bool | str = True,
        commit_pause: str | None = None,
    ) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise PayloadError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        self.base_urls = _normalize(base_urls)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(
            connect_timeout_s if connect_timeout_s is not None else min(10.0, self.timeout_s)
        )
        self.verify = verify
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise PayloadError("api_key: expected a non-empty string")
        self._api_key = api_key
        if commit_pause is not None:
            check_pause_mode(commit_pause, "commit_pause")
        self.commit_pause = commit_pause
        self._session = self._new_session(pool_maxsize=8)

    def _new_session(self, pool_maxsize: int) -> requests.Session:
        session = requests.Session()
        adapter = HTTPAdapter(
            pool_connections=max(10, len(self.base_urls)), pool_maxsize=pool_maxsize, max_retries=0
        )
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        session.headers["Accept"] = "application/json"
        session.headers["Accept-Encoding"] = "identity"  # what is read is what was sent
        if self._api_key is not None:
            session.headers["Authorization"] = f"Bearer {self._api_key}"
        return session

    def __repr__(self) -> str:
        return f"HTTPWeightSyncClient({self.base_urls!r}, timeout_s={self.timeout_s:g})"

    def _request(
        self,
        base_url: str,
        method: str,
        route: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        round_id: str | None = None,
        *,
        session: requests.Session | None = None,
    ) -> Any:
        where = f"{method} {route}"
        data = None
        headers = {} if round_id is None else {ROUND_HEADER: round_id}
        if body is not None:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        try:
            r = (session or self._session).request(
                method,
                base_url + route,
                data=data,
                params=params,
                headers=headers,
                timeout=(self.connect_timeout_s, self.timeout_s),
                verify=self.verify,
                stream=True,  # read below, bounded
            )
            try:
                failed = r.status_code >= 400
                content, complete = _read_bounded(
                    r, MAX_ERROR_BYTES if failed else MAX_ANSWER_BYTES
                )
            finally:
                r.close()  # back to the pool when read to the end, dropped otherwise
        except requests.Timeout as e:
            raise TransferTimeoutError(
                f"{where}: no answer within {self.timeout_s:g} s ({type(e).__name__})"
            ) from e
        except requests.RequestException as e:
            raise HTTPConnectionError(f"{where}: {type(e).__name__}: {e}") from e
        if failed:
            message, error_type = _server_message(content, complete, r.reason, r.status_code)
            raise HTTPStatusError(r.status_code, where, message, error_type)
        if not complete:
            raise HTTPStatusError(
                r.status_code, where, f"answer over the limit of {MAX_ANSWER_BYTES} bytes"
            )
        if not content:
            return None
        try:
            return json.loads(content)
        except ValueError as e:
            raise HTTPStatusError(
                r.status_code, where, f"answer is not JSON: {content[:200]!r}"
            ) from e

    def _request_retrying(
        self, base_url: str, method: str, route: str, params: dict[str, str] | None = None
    ) -> Any:
        """Once more on a fresh connection if the pooled one was dead (a server may close its
        side after an error), so ``finally: client.resume()`` survives a stale socket."""
        try:
            return self._request(base_url, method, route, params=params)
        except HTTPConnectionError as e:
            log.info("%s %s%s: %s; retrying once on a fresh connection", method, base_url, route, e)
        fresh = self._new_session(pool_maxsize=1)
        try:
            return self._request(base_url, method, route, params=params, session=fresh)
        finally:
            fresh.close()

    def _targets(self, call: str, *args: Any, **kwargs: Any) -> list[Target[Any]]:
        return [
            (url, functools.partial(self._call, url, call, *receiver_args(args, i), **kwargs))
            for i, url in enumerate(self.base_urls)
        ]

    def _receiver_count(self) -> int:
        return len(self.base_urls)

    def _deadline_s(self) -> float:
        return self.timeout_s + _GRACE_S

    def _call(self, url: str, call: str, *args: Any, round_id: str | None = None) -> Any:
        """One call on one replica; ``round_id`` travels in a header so the bodies stay vLLM's."""
        post = functools.partial(self._request, url, "POST", f"/{call}", round_id=round_id)
        if call == "init_weight_transfer_engine":
            return post({"init_info": args[0]})
        if call == "update_weights":
            return post({"update_info": args[0]})
        if call == "finish_weight_update":
            return post(None if args[0] is None else {"weight_version": args[0]})
        if call == "update_weight_version":
            return post({"new_version": args[0]})
        if call == "start_weight_update":
            return post()
        if call == "weight_checker":
            action, baseline = args
            return post({"action": action, **({} if baseline is None else {"baseline": baseline})})
        if call == "abort_weight_update":
            return self._abort(url, args[0], round_id)
        if call in ("pause", "resume"):
            return self._request_retrying(url, "POST", f"/{call}", params=args[0] if args else None)
        if call == "get_world_size":
            flag = None if args[0] else {"include_dp": "false"}  # vLLM's default is true
            return self._request_retrying(url, "GET", "/get_world_size", params=flag)
        if call == "checksums":
            return self._request_retrying(url, "POST", "/weight_checksums")["checksums"]
        assert call in IDEMPOTENT_CALLS, call
        return self._request_retrying(url, "GET", f"/{call}")  # weight_info, health, is_paused

    def _abort(self, url: str, reason: str, round_id: str | None) -> None:
        """wtcore's own route: a 404 (a vLLM server) is skipped, since the next init abandons
        the open round anyway."""
        try:
            self._request(
                url, "POST", "/abort_weight_update", {"reason": reason}, round_id=round_id
            )
        except HTTPStatusError as e:
            if e.status != 404:
                raise
            log.info("%s has no /abort_weight_update route; abort skipped there", url)

    def weight_checker(
        self, action: str, baselines: Sequence[dict[str, str]] | None = None
    ) -> list[dict[str, Any]]:
        """vLLM's ``POST /weight_checker`` on every replica (``"compare"``: a baseline each)."""
        if baselines is not None and len(baselines) != len(self.base_urls):
            raise PayloadError(
                f"baselines: expected one per replica ({len(self.base_urls)}), got {len(baselines)}"
            )
        each = None if baselines is None else PerReceiver(tuple(baselines))
        return self._each("weight_checker", action, each, round_id=new_round_id())

    def world_sizes(self, *, include_dp: bool = True) -> list[int]:
        """``GET /get_world_size`` of every replica, in ``base_urls`` order."""
        out = []
        answers = self._each("get_world_size", include_dp)
        for url, answer in zip(self.base_urls, answers, strict=True):
            size = answer.get("world_size") if isinstance(answer, dict) else None
            if not isinstance(size, int) or isinstance(size, bool):
                raise PayloadError(f"{url}/get_world_size: expected a world_size, got {answer!r}")
            out.append(size)
        return out

    def get_world_size(self, *, include_dp: bool = True) -> int:
        """The inference world size, which every replica must report alike."""
        sizes = self.world_sizes(include_dp=include_dp)
        if len(set(sizes)) != 1:
            listed = ", ".join(f"{u}: {s}" for u, s in zip(self.base_urls, sizes, strict=True))
            raise PayloadError(f"get_world_size: the replicas disagree ({listed})")
        return sizes[0]

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.commit_pause is None:
            super().finish_weight_update(weight_version)
            return
        self.pause(self.commit_pause)
        try:
            super().finish_weight_update(weight_version)
        finally:
            self.resume()

    def pause(self, mode: str = "abort", *, clear_cache: bool | None = None) -> None:
        """``POST /pause?mode=...`` (vLLM): stop generating while weights change."""
        params = {"mode": check_pause_mode(mode)}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        self._each("pause", params)

    def resume(self) -> None:
        self._each("resume")

    def is_paused(self) -> list[bool]:
        return [bool(a.get("is_paused")) for a in self._each("is_paused")]

    def health(self) -> list[dict[str, Any]]:
        return self._each("health")

    def close(self) -> None:
        self._session.close()


def _read_bounded(r: requests.Response, limit: int) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of the body as they arrive; whether that was all of it."""
    data = bytearray()
    for chunk in r.iter_content(_READ_CHUNK):
        data += chunk
        if len(data) > limit:
            return bytes(data[:limit]), False
    return bytes(data), True


def _server_message(
    content: bytes, complete: bool, reason: str | None, status: int
) -> tuple[str, str | None]:
    """The server's message and error class, from wtcore's, vLLM's or FastAPI's error shapes."""
    body: Any = None
    if complete:
        try:
            body = json.loads(content)
        except ValueError:
            body = None
    if body is None:  # cut short, or not JSON: show the start of the text
        text = content[:500].decode("utf-8", "replace").strip()
        more = f" (cut at {MAX_ERROR_BYTES} bytes)" if not complete else ""
        return (text or reason or "no message") + more, None
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):  # OpenAI-style {"error": {"message": ..., "type": ...}}
            kind = err.get("type")
            err = str(err.get("message", err))
        else:  # wtcore's ErrorRecord has "error_type" (and "status") beside "error"
            kind = body.get("error_type")
        if err is not None:
            fields = {"error": err, "error_type": kind, "status": body.get("status", status)}
            try:  # a class name only from what passes the record's checks
                record = ErrorRecord.from_json(fields)
            except PayloadError:
                return str(err), None
            return record.message, record.type
    return json.dumps(body)[:500], None
