"""Every route with bad input: the right status and message, and nothing applied (checked)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch

from wtcore import ReceiverError, TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.errors import ErrorRecord
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

KEY = "s3cret-token"
SIZE, TENSORS = 64 << 10, 12
MAX_BODY = 256 << 10
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server(
        "--api-key", KEY, "--max-body", str(MAX_BODY), "--size", str(SIZE),
        "--tensors", str(TENSORS), "--seed", "0",
    )  # fmt: skip


def _send_v1(server: Any) -> dict[str, str]:
    """A full round of version ``v1``; returns its digests."""
    state = synthetic_state(SIZE, TENSORS, "float32", seed=5)
    with HTTPWeightSyncClient(server.url, api_key=KEY, timeout_s=60) as client:
        trainer = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=16 << 10),
            client=client,
            source=TensorSource(state),
        )
        trainer.send_weights(weight_version="v1")
        want = digest_named(state.items())
        assert client.checksums() == [want]
        return want


@pytest.fixture(scope="module")
def baseline(server: Any) -> Iterator[dict[str, str]]:
    """One good round (version ``v1``); returns the digests every bad request must keep."""
    yield _send_v1(server)


def call(server: Any, method: str, path: str, body: Any = b"", **headers: str) -> Any:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    hdrs = {**AUTH, "Content-Type": "application/json", **headers}
    hdrs = {k: v for k, v in hdrs.items() if v}
    return requests.request(method, server.url + path, data=body, headers=hdrs, timeout=30)


def assert_unchanged(server: Any, baseline: dict[str, str], state: str = "idle") -> None:
    info = call(server, "GET", "/weight_info").json()
    assert info["weight_version"] == "v1"
    assert info["consistent"] is True
    assert info["state"] == state
    assert call(server, "POST", "/weight_checksums").json()["checksums"] == baseline


def check(r: requests.Response, status: int, *fragments: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == status
    assert ErrorRecord.from_json(body).to_json() == body  # every error body is a record
    for fragment in fragments:
        assert fragment in body["error"], body["error"]


INIT_OK = {"init_info": {"packed_buffer_size_bytes": 16 << 10}}

# (method, path, body, status, fragments of the message)
IDLE_CASES = [
    ("POST", "/init_weight_transfer_engine", b"{not json", 400, ["malformed JSON"]),
    ("POST", "/init_weight_transfer_engine", b"\xff\xfe", 400, ["body: not UTF-8"]),
    ("POST", "/init_weight_transfer_engine", [1, 2], 400, ["expected a JSON object", "list"]),
    ("POST", "/init_weight_transfer_engine", {}, 400, ["body.init_info: missing"]),
    ("POST", "/init_weight_transfer_engine", b"", 400, ["body.init_info: missing"]),
    (
        "POST",
        "/init_weight_transfer_engine",
        {**INIT_OK, "rank": 3},
        400,
        ["unknown field(s) 'rank'", "valid fields: init_info"],
    ),
    ("POST", "/init_weight_transfer_engine", {"init_info": "x"}, 400, ["init_info: expected"]),
    (
        "POST",
        "/init_weight_transfer_engine",
        {"init_info": {"packed_buffer_size_bytes": "16k"}},
        400,
        ["init_info.packed_buffer_size_bytes", "expected int", "'16k'"],
    ),
    (
        "POST",
        "/init_weight_transfer_engine",
        {"init_info": {"packed_buffer_size_bytes": 1, "bogus": 2}},
        400,
        ["init_info: unknown field(s) 'bogus'"],
    ),
    (
        "POST",
        "/init_weight_transfer_engine",
        {"init_info": {}},
        400,
        ["init_info.packed_buffer_size_bytes: missing required field"],
    ),
    ("POST", "/start_weight_update", {"now": True}, 400, ["'now'", "takes no body"]),
    ("POST", "/start_weight_update", b"[", 400, ["malformed JSON"]),
    ("POST", "/update_weights", {"update_info": {}}, 409, ["call start_weight_update first"]),
    ("POST", "/finish_weight_update", {}, 409, ["call start_weight_update first"]),
    ("POST", "/finish_weight_update", {"weight_version": 3}, 400, ["weight_version", "int 3"]),
    ("POST", "/weight_checksums", {"names": ["x"]}, 400, ["'names'", "takes no body"]),
    ("POST", "/pause?mode=later", b"", 400, ["mode: expected one of abort, wait, keep"]),
    ("POST", "/pause?mode=keep&now=1", b"", 400, ["unknown query parameter(s) ['now']"]),
    ("POST", "/pause?clear_cache=maybe", b"", 400, ["clear_cache"]),
    ("POST", "/resume", {"x": 1}, 400, ["takes no body"]),
    ("POST", "/resume?mode=keep", b"", 400, ["takes no query parameters"]),
    ("GET", "/weight_info?x=1", b"", 400, ["takes no query parameters"]),
    ("GET", "/update_weights", b"", 405, ["accepts POST, not GET"]),
    ("POST", "/weight_info", b"", 405, ["accepts GET, not POST"]),
    ("POST", "/load_weights", b"", 404, ["no route '/load_weights'"]),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "fragments"),
    IDLE_CASES,
    ids=[f"{c[0]} {c[1]} {c[3]} {i}" for i, c in enumerate(IDLE_CASES)],
)
def test_bad_request_between_rounds(
    server: Any,
    baseline: dict[str, str],
    method: str,
    path: str,
    body: Any,
    status: int,
    fragments: list[str],
) -> None:
    check(call(server, method, path, body), status, *fragments)
    assert_unchanged(server, baseline)


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({"Authorization": ""}, "missing Authorization"),
        ({"Authorization": "Bearer wrong"}, "invalid API key"),
        ({"Authorization": f"Basic {KEY}"}, "invalid API key"),
        ({"Authorization": f"Bearer {KEY}x"}, "invalid API key"),
    ],
)
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/init_weight_transfer_engine", INIT_OK),
        ("POST", "/start_weight_update", b""),
        ("POST", "/update_weights", {"update_info": {}}),
        ("POST", "/finish_weight_update", {"weight_version": "evil"}),
        ("POST", "/pause", b""),
        ("POST", "/resume", b""),
        ("POST", "/weight_checksums", b""),
        ("GET", "/weight_info", b""),
        ("GET", "/get_world_size", b""),
        ("GET", "/is_paused", b""),
    ],
)
def test_token_is_required(
    server: Any,
    baseline: dict[str, str],
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    fragment: str,
) -> None:
    r = call(server, method, path, body, **headers)
    check(r, 401, fragment)
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert_unchanged(server, baseline)
    assert call(server, "GET", "/is_paused").json() == {"is_paused": False}


def test_health_needs_no_token(server: Any) -> None:
    r = requests.get(server.url + "/health", timeout=30)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_client_without_token_names_the_url(server: Any, baseline: dict[str, str]) -> None:
    with (
        HTTPWeightSyncClient(server.url, timeout_s=30) as client,
        pytest.raises(ReceiverError) as err,
    ):
        client.start_weight_update()
    assert err.value.failures[0].receiver == server.url
    assert err.value.failures[0].status == 401
    assert "missing Authorization" in str(err.value)
    assert_unchanged(server, baseline)


def test_body_over_the_limit(server: Any, baseline: dict[str, str]) -> None:
    big = {"update_info": {"data": "A" * MAX_BODY}}
    check(call(server, "POST", "/update_weights", big), 413, "over the limit", str(MAX_BODY))
    check(call(server, "POST", "/init_weight_transfer_engine", big), 413, "over the limit")
    assert_unchanged(server, baseline)
    # the connection was closed unread; the next request is served normally
    assert call(server, "GET", "/health").status_code == 200


def test_bad_content_length(server: Any, baseline: dict[str, str]) -> None:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + b"Content-Length: lots\r\n\r\n"
        )
        chunks = []
        while chunk := s.recv(65536):  # the server closes the connection after answering
            chunks.append(chunk)
        answer = b"".join(chunks).decode()
    assert answer.startswith("HTTP/1.1 400"), answer
    assert "Content-Length: expected 1 to 18 ASCII digits" in answer
    assert_unchanged(server, baseline)


def _bad_update_cases() -> list[tuple[Any, str]]:
    entry = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[2]], "data": ""}
    return [
        (b"{", "malformed JSON"),
        ({}, "body.update_info: missing"),
        ({"update_info": entry, "version": 1}, "unknown field(s) 'version'"),
        ({"update_info": 7}, "update_info: expected a JSON object or a list"),
        ({"update_info": [entry, entry]}, "one entry per worker rank, expected 1, got 2"),
        ({"update_info": {**entry, "names": "lm_head.weight"}}, "update_info.names"),
        ({"update_info": {**entry, "shapes": [["2"]]}}, "update_info.shapes"),
        ({"update_info": {k: v for k, v in entry.items() if k != "data"}}, "update_info.data"),
        ({"update_info": {**entry, "dtype_names": ["complex32"]}}, "complex32"),
        ({"update_info": {**entry, "extra": 1}}, "update_info: unknown field(s) 'extra'"),
    ]


def test_bad_updates_inside_a_round_leave_it_open(server: Any, baseline: dict[str, str]) -> None:
    assert call(server, "POST", "/start_weight_update").status_code == 200
    try:
        check(call(server, "POST", "/start_weight_update"), 409, "already in progress")
        check(call(server, "POST", "/init_weight_transfer_engine", {"init_info": 1}), 400)
        for body, fragment in _bad_update_cases():
            r = call(server, "POST", "/update_weights", body)
            assert r.status_code == 400, (body, r.text)
            assert fragment in r.json()["error"], r.text
            assert_unchanged(server, baseline, state="updating")
    finally:
        # Nothing was applied, so there is nothing to publish: finish is refused (409) and
        # the round stays open until the trainer aborts it.
        r = call(server, "POST", "/finish_weight_update", {"weight_version": "v1"})
        check(r, 409, "applied no update_weights")
        assert call(server, "POST", "/abort_weight_update").status_code == 200
    assert_unchanged(server, baseline)


_ONES = __import__("base64").b64encode(torch.ones(2).numpy().tobytes()).decode()
_ENTRY = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[2]]}


@pytest.mark.parametrize(
    ("update_info", "fragments"),
    [
        (
            {**_ENTRY, "names": ["no.such.weight"], "data": _ONES},
            ["'no.such.weight': unknown parameter name", "nothing of this batch"],
        ),
        ({**_ENTRY, "data": _ONES}, ["'lm_head.weight': shape mismatch"]),
        ({**_ENTRY, "data": "!!notbase64"}, ["update_info.data: not valid base64"]),
        ({**_ENTRY, "data": _ONES[:4]}, ["update_info.data: expected 8 bytes", "got 3"]),
    ],
    ids=["unknown-name", "wrong-shape", "bad-base64", "short-data"],
)
def test_a_rejected_batch_is_not_applied(
    server: Any, baseline: dict[str, str], update_info: dict[str, Any], fragments: list[str]
) -> None:
    """Well-formed but unloadable: 400 and nothing loaded. The core ends such a round
    (earlier batches of it may be applied), so it is not published and reads inconsistent."""
    assert call(server, "POST", "/start_weight_update").status_code == 200
    r = call(server, "POST", "/update_weights", {"update_info": update_info})
    check(r, 400, *fragments)
    info = call(server, "GET", "/weight_info").json()
    assert info["weight_version"] == "v1" and info["state"] == "idle"
    assert info["consistent"] is False and fragments[0] in info["last_error"]
    assert call(server, "POST", "/weight_checksums").json()["checksums"] == baseline
    check(call(server, "POST", "/finish_weight_update", {}), 409, "start_weight_update first")
    # a round that writes nothing (one empty update) publishes, but the weights stay
    # inconsistent: the worker cannot know what the failed round wrote
    empty = {"names": [], "dtype_names": [], "shapes": [], "data": ""}
    assert call(server, "POST", "/start_weight_update").status_code == 200
    assert call(server, "POST", "/update_weights", {"update_info": empty}).ok
    assert call(server, "POST", "/finish_weight_update", {"weight_version": "v1"}).ok
    assert call(server, "GET", "/weight_info").json()["consistent"] is False
    # a full round makes the receiver consistent again
    assert _send_v1(server) == baseline
    assert_unchanged(server, baseline)
