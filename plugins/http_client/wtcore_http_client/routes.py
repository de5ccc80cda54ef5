"""The receiver's HTTP routes, free of any web framework, so the rules live here once.

:class:`ReceiverRoutes` turns ``(method, path, headers, body)`` into ``(status, JSON)``, checking
only the envelope (JSON, keys, auth, sizes) and delegating every call to a
:class:`wtcore.WeightSyncWorker`. :meth:`~ReceiverRoutes.handle` blocks as long as the call does,
so an async framework must run it in a thread pool. See docs/http.md.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from wtcore.errors import ErrorRecord, PayloadError, ProtocolStateError
from wtcore.rounds import MAX_VERSION_CHARS, ROUND_HEADER, check_required
from wtcore.worker import WeightSyncWorker
from wtcore_http_client.framing import FramingError, parse_content_length
from wtcore_http_client.pause import check_pause_mode

__all__ = [
    "CONTROL_MAX_BODY_BYTES",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_INT_DIGITS",
    "MAX_JSON_DEPTH",
    "MAX_VERSION_CHARS",
    "ROUTES",
    "ReceiverRoutes",
    "Response",
]

log = logging.getLogger("wtcore_http_client.routes")

#: Large enough for a 32 MiB ``inline`` bucket in base64; control messages are tiny.
DEFAULT_MAX_BODY_BYTES = 64 << 20
#: The body limit of every POST route but the two that carry engine payloads.
CONTROL_MAX_BODY_BYTES = 64 << 10
#: Routes whose bodies may be as large as ``max_body_bytes``.
_BULK_ROUTES = frozenset({"/update_weights", "/init_weight_transfer_engine"})
#: Deepest JSON nesting accepted: real payloads are 3 levels deep.
MAX_JSON_DEPTH = 32
#: Most digits of a JSON integer: 2**63 has 19; shapes and sizes never need more.
MAX_INT_DIGITS = 20
#: Most characters of a JSON object key and of a ``weight_version`` (echoed by ``/weight_info``).
MAX_KEY_CHARS = 256
#: Most characters of an abort ``reason`` (kept in ``last_error``).
MAX_REASON_CHARS = 1024

#: ``path -> (method, authenticated)``.
ROUTES: dict[str, tuple[str, bool]] = {
    "/health": ("GET", False),
    "/weight_info": ("GET", True),
    "/get_world_size": ("GET", True),
    "/is_paused": ("GET", True),
    "/init_weight_transfer_engine": ("POST", True),
    "/start_weight_update": ("POST", True),
    "/update_weights": ("POST", True),
    "/finish_weight_update": ("POST", True),
    "/update_weight_version": ("POST", True),
    "/pause": ("POST", True),
    "/resume": ("POST", True),
    "/weight_checksums": ("POST", True),
    "/weight_checker": ("POST", True),
    "/abort_weight_update": ("POST", True),
}


class Response(NamedTuple):
    status: int
    body: dict[str, Any]


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.record = ErrorRecord(error_type, message, status)


def _error(error: BaseException) -> Response:
    record = ErrorRecord.from_exception(error)
    return Response(record.status, record.to_json())


#: The routes that ``require_round_id`` refuses without an id.
_ROUND_ROUTES = frozenset(
    (
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
    )
)


class ReceiverRoutes:
    """vLLM's RL routes plus health, info, pause/resume, checksums and abort, over one worker.

    ``on_pause(mode, clear_cache)`` / ``on_resume()`` let an inference server stop generating.
    ``require_round_id`` refuses (409) an unowned round, for a worker shared with other code.
    """

    def __init__(
        self,
        worker: WeightSyncWorker,
        *,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_pause: Callable[[str, bool], None] | None = None,
        on_resume: Callable[[], None] | None = None,
        require_round_id: bool = False,
    ) -> None:
        if api_key is not None and not api_key:
            raise PayloadError("api_key: expected a non-empty string or None")
        if max_body_bytes <= 0:
            raise PayloadError(f"max_body_bytes: must be positive, got {max_body_bytes}")
        if not isinstance(require_round_id, bool):
            raise PayloadError(f"require_round_id: expected a bool, got {require_round_id!r}")
        self.worker = worker
        self.require_round_id = require_round_id
        self.max_body_bytes = max_body_bytes
        self._token = api_key.encode() if api_key else None
        self._on_pause = on_pause
        self._on_resume = on_resume
        self._pause_lock = threading.Lock()
        self.paused = False
        self.pause_mode: str | None = None

    @property
    def requires_auth(self) -> bool:
        return self._token is not None

    def handle(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes | bytearray
    ) -> Response:
        try:
            return self._dispatch(method.upper(), path, headers, body)
        except (_HTTPError, PayloadError, ProtocolStateError) as e:  # the caller's mistake
            return _error(e)
        except Exception as e:
            log.exception("%s %s failed", method, path)
            record = ErrorRecord.from_exception(e)  # its message also names the class
            record = replace(record, message=f"{record.type}: {record.message}")
            return Response(record.status, record.to_json())

    def check_auth(self, headers: Mapping[str, str]) -> None:
        """Raise 401 unless the bearer token matches (constant time)."""
        if self._token is None:
            return
        value = _header(headers, "authorization")
        if value is None:
            raise _HTTPError(401, "missing Authorization: Bearer <api key> header", "AuthError")
        scheme, _, given = value.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self._token
        ):
            raise _HTTPError(401, "invalid API key", "AuthError")

    def body_limit(self, method: str, path: str) -> int:
        if method.upper() in ("GET", "HEAD"):
            return 0
        if path in _BULK_ROUTES:
            return self.max_body_bytes
        return min(self.max_body_bytes, CONTROL_MAX_BODY_BYTES)

    def precheck(self, method: str, path: str, headers: Mapping[str, str]) -> Response | None:
        """Auth, route and declared-size checks, before a server reads the body."""
        try:
            route = self._route(method.upper(), urlsplit(path).path, headers)
            raw = _header(headers, "content-length")
            if raw is not None:
                try:
                    length = parse_content_length(raw)
                except FramingError as e:
                    raise _HTTPError(e.status, e.message, "PayloadError") from None
                self._check_length(method, route, length)
        except (_HTTPError, PayloadError) as e:
            return _error(e)
        return None

    def _check_length(self, method: str, path: str, length: int) -> None:
        limit = self.body_limit(method, path)
        if limit == 0 and length:
            raise _HTTPError(
                400, f"{method} {path} takes no body, got {length} bytes", "PayloadError"
            )
        if length > limit:
            raise _HTTPError(
                413,
                f"request body of {length} bytes is over the limit of {limit} bytes for {path}",
                "PayloadTooLarge",
            )

    def _route(self, method: str, path: str, headers: Mapping[str, str]) -> str:
        # Auth first: an unauthenticated caller learns nothing about routes but /health.
        if path != "/health":
            self.check_auth(headers)
        spec = ROUTES.get(path)
        if spec is None:
            raise _HTTPError(404, f"no route {path[:100]!r} (docs/http.md lists them)", "NotFound")
        allowed, _needs_auth = spec
        if method != allowed:
            raise _HTTPError(405, f"{path} accepts {allowed}, not {method}", "MethodNotAllowed")
        return path

    def _dispatch(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | bytearray
    ) -> Response:
        parts = urlsplit(target)
        path = self._route(method, parts.path, headers)
        self._check_length(method, path, len(body))
        query = parse_qs(parts.query, keep_blank_values=True)
        w = self.worker
        round_id = _header(headers, ROUND_HEADER.lower())  # the worker checks its form
        if path not in ("/pause", "/get_world_size") and query:
            raise PayloadError(f"{path}: takes no query parameters, got {sorted(query)}")
        if path in _ROUND_ROUTES:
            check_required(path.lstrip("/"), round_id, self.require_round_id)
        if path == "/health":
            return Response(200, {"status": "ok"})
        if path == "/weight_info":
            return Response(200, {**w.weight_info(), "paused": self.paused})
        if path == "/get_world_size":
            _include_dp(query)  # a receiver has no data-parallel replicas: the same size
            return Response(200, {"world_size": w.world_size})
        if path == "/is_paused":
            return Response(200, {"is_paused": self.paused})
        if path == "/init_weight_transfer_engine":
            fields = _json_object(body, required=("init_info",))
            init_info = fields["init_info"]
            if not isinstance(init_info, dict):
                raise PayloadError(f"init_info: expected a JSON object, got {_kind(init_info)}")
            w.init_weight_transfer_engine(init_info, round_id=round_id)
        elif path == "/start_weight_update":
            _json_object(body)
            w.start_weight_update(round_id=round_id)
        elif path == "/update_weights":
            fields = _json_object(body, required=("update_info",))
            w.update_weights(fields["update_info"], round_id=round_id)  # checks dict | list
        elif path == "/finish_weight_update":
            fields = _json_object(body, optional=("weight_version",))
            version = fields.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise PayloadError(
                    f"weight_version: expected a string or null, got {_kind(version)}"
                )
            w.finish_weight_update(version, round_id=round_id)  # which bounds its length
        elif path == "/update_weight_version":
            version = _json_object(body, required=("new_version",))["new_version"]
            if not isinstance(version, str):
                raise PayloadError(f"new_version: expected a string, got {_kind(version)}")
            w.update_weight_version(version, round_id=round_id)
            return Response(200, {"success": True, "new_version": version})
        elif path == "/pause":
            _json_object(body)
            self._pause(query)
        elif path == "/resume":
            _json_object(body)
            with self._pause_lock:
                if self._on_resume is not None:
                    self._on_resume()
                self.paused, self.pause_mode = False, None
        elif path == "/weight_checksums":
            _json_object(body)
            return Response(200, {"checksums": w.checksums()})
        elif path == "/weight_checker":
            fields = _json_object(body, required=("action",), optional=("baseline",))
            answer = w.weight_checker(fields["action"], fields.get("baseline"), round_id=round_id)
            return Response(200, answer)
        elif path == "/abort_weight_update":
            reason = _json_object(body, optional=("reason",)).get(
                "reason", "aborted by the trainer"
            )
            if not isinstance(reason, str):
                raise PayloadError(f"reason: expected a string, got {_kind(reason)}")
            if len(reason) > MAX_REASON_CHARS:
                raise PayloadError(
                    f"reason: {len(reason)} characters, over the limit of {MAX_REASON_CHARS}"
                )
            w.abort_weight_update(reason, round_id=round_id)
        return Response(200, {"status": "ok"})

    def _pause(self, query: dict[str, list[str]]) -> None:
        unknown = sorted(set(query) - {"mode", "clear_cache"})
        if unknown:
            raise PayloadError(
                f"/pause: unknown query parameter(s) {unknown}; valid: mode, clear_cache"
            )
        mode = check_pause_mode(query.get("mode", ["abort"])[-1])
        clear_raw = query.get("clear_cache", ["true"])[-1].lower()
        if clear_raw not in ("true", "false", "1", "0"):
            raise PayloadError(f"clear_cache: expected true or false, got {clear_raw!r}")
        with self._pause_lock:
            if self._on_pause is not None:
                self._on_pause(mode, clear_raw in ("true", "1"))
            self.paused, self.pause_mode = True, mode


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """The one value of header ``name``; two (in any case) are refused, not picked from."""
    found = [value for key, value in headers.items() if key.lower() == name]
    if len(found) > 1:
        raise _HTTPError(400, f"header {name}: sent more than once", "PayloadError")
    return found[0] if found else None


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise PayloadError(
            f"body: an integer of {digits} digits, over the limit of {MAX_INT_DIGITS}"
        )
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise PayloadError(f"body: number {text[:40]!r} overflows a float")
    return value


def _parse_constant(text: str) -> Any:
    raise PayloadError(f"body: {text} is not JSON (RFC 8259 has no NaN or Infinity)")


def _check_tree(data: Any) -> None:
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise PayloadError(f"body: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if len(key) > MAX_KEY_CHARS:
                    raise PayloadError(
                        f"body: a key of {len(key)} characters, over the limit of {MAX_KEY_CHARS}"
                    )
                if isinstance(item, (dict, list)):
                    stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value if isinstance(item, (dict, list)))


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:57] + '...' if len(text) > 60 else text}"


def _include_dp(query: dict[str, list[str]]) -> bool:
    unknown = sorted(set(query) - {"include_dp"})
    if unknown:
        raise PayloadError(
            f"/get_world_size: unknown query parameter(s) {unknown}; valid: include_dp"
        )
    values = query.get("include_dp", ["true"])
    if len(values) != 1 or values[0].lower() not in ("true", "false", "1", "0"):
        raise PayloadError(f"include_dp: expected true or false, got {values!r:.60}")
    return values[0].lower() in ("true", "1")


def _json_object(
    body: bytes | bytearray, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A body that must be a JSON object with exactly these keys (empty = ``{}``)."""
    if not body.strip():
        data: Any = {}
    else:
        try:
            text = bytes(body).decode("utf-8")  # JSON is UTF-8 (RFC 8259); no guessing
        except UnicodeDecodeError as e:
            raise PayloadError(f"body: not UTF-8 ({e})") from None
        try:
            data = json.loads(
                text,
                parse_int=_parse_int,
                parse_float=_parse_float,
                parse_constant=_parse_constant,
            )
        except json.JSONDecodeError as e:
            raise PayloadError(f"body: malformed JSON ({e})") from None
        except RecursionError:
            raise PayloadError(f"body: nested deeper than {MAX_JSON_DEPTH} levels") from None
        _check_tree(data)
    if not isinstance(data, dict):
        raise PayloadError(f"body: expected a JSON object, got {_kind(data)}")
    valid = (*required, *optional)
    unknown = sorted(set(data) - set(valid))
    if unknown:
        listed = ", ".join(map(repr, unknown))
        raise PayloadError(
            f"body: unknown field(s) {listed}; "
            + (f"valid fields: {', '.join(valid)}" if valid else "this route takes no body")
        )
    for name in required:
        if name not in data:
            raise PayloadError(f"body.{name}: missing required field")
    return data
