"""The wire contract: request bodies pinned against docs/protocol.md, and the client's error reports.

A tiny recording HTTP server (stdlib, real sockets on 127.0.0.1) stands in for a vLLM server:
it records exactly what the client sends and answers what each test tells it to.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from wtcore import ReceiverError, WeightSyncWorker
from wtcore.rounds import ROUND_HEADER, new_round_id
from wtcore.sink import ModuleSink
from wtcore.testing.sources import build_module, mixed_dtype_state
from wtcore_http_client import HTTPWeightSyncClient, ReceiverRoutes

pytestmark = pytest.mark.timeout(60)


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Recorder:
    url: str
    requests: list[Recorded] = field(default_factory=list)
    # (status, body bytes, content type) for the next answers; default 200 {"status": "ok"}
    answer: Callable[[Recorded], tuple[int, bytes, str]] | None = None


@pytest.fixture()
def recorder() -> Iterator[Recorder]:
    yield from _recorder()


def _recorder() -> Iterator[Recorder]:
    rec = Recorder(url="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            got = Recorded(self.command, self.path, dict(self.headers.items()), self.rfile.read(n))
            rec.requests.append(got)
            status, data, ctype = (
                rec.answer(got) if rec.answer else (200, b'{"status": "ok"}', "application/json")
            )
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _any

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _json(r: Recorded) -> Any:
    return json.loads(r.body) if r.body else None


# ---------------------------------------------------------------------- protocol.md bodies
@pytest.mark.processes
def test_request_bodies_match_design_section_4(recorder: Recorder) -> None:
    init_info = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                 "world_size": 3, "packed": True}  # fmt: skip
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}
    with HTTPWeightSyncClient(recorder.url + "/", timeout_s=10) as client:
        client.init_weight_transfer_engine(init_info)
        client.start_weight_update()
        client.update_weights(update)
        client.update_weights([update, update])
        client.finish_weight_update("step-42")
        client.finish_weight_update()
    got = [(r.method, r.path, _json(r)) for r in recorder.requests]
    assert got == [
        ("POST", "/init_weight_transfer_engine", {"init_info": init_info}),
        ("POST", "/start_weight_update", None),
        ("POST", "/update_weights", {"update_info": update}),
        ("POST", "/update_weights", {"update_info": [update, update]}),
        ("POST", "/finish_weight_update", {"weight_version": "step-42"}),
        ("POST", "/finish_weight_update", None),
    ]
    for r in recorder.requests:
        if r.body:
            assert r.headers["Content-Type"] == "application/json"
        else:
            assert r.headers.get("Content-Length", "0") == "0"
        assert "Authorization" not in r.headers


@pytest.mark.processes
def test_vllm_extras_and_bearer_token(recorder: Recorder) -> None:
    def answer(r: Recorded) -> tuple[int, bytes, str]:
        bodies = {
            "/get_world_size": {"world_size": 4},
            "/is_paused": {"is_paused": True},
            "/weight_info": {"weight_version": "v7"},
            "/weight_checksums": {"checksums": {"w": "abc"}},
        }
        return 200, json.dumps(bodies.get(r.path.split("?")[0], {})).encode(), "application/json"

    recorder.answer = answer
    with HTTPWeightSyncClient(recorder.url, api_key="tok", timeout_s=10) as client:
        client.pause()
        client.pause(mode="keep", clear_cache=False)
        client.resume()
        assert client.get_world_size() == 4
        assert client.is_paused() == [True]
        assert client.weight_info() == [{"weight_version": "v7"}]
        assert client.checksums() == [{"w": "abc"}]
    got = [(r.method, r.path, r.body) for r in recorder.requests]
    assert got == [
        ("POST", "/pause?mode=abort", b""),
        ("POST", "/pause?mode=keep&clear_cache=false", b""),
        ("POST", "/resume", b""),
        ("GET", "/get_world_size", b""),
        ("GET", "/is_paused", b""),
        ("GET", "/weight_info", b""),
        ("POST", "/weight_checksums", b""),
    ]
    assert {r.headers["Authorization"] for r in recorder.requests} == {"Bearer tok"}


def test_the_routes_accept_exactly_those_bodies() -> None:
    """The framework-agnostic handler, called directly as a FastAPI/Starlette app would."""
    state = mixed_dtype_state(0)
    worker = WeightSyncWorker("inline", ModuleSink(build_module(state)))
    routes = ReceiverRoutes(worker)

    def post(path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        raw = b"" if body is None else json.dumps(body).encode()
        return tuple(routes.handle("POST", path, {"Content-Type": "application/json"}, raw))  # type: ignore[return-value]

    empty = {"names": [], "dtype_names": [], "shapes": [], "data": ""}
    assert (
        post("/init_weight_transfer_engine", {"init_info": {"packed_buffer_size_bytes": 64}})[0]
        == 200
    )
    assert post("/start_weight_update") == (200, {"status": "ok"})
    assert post("/update_weights", {"update_info": empty})[0] == 200
    assert post("/update_weights", {"update_info": [empty]})[0] == 200
    assert post("/finish_weight_update", {"weight_version": "step-42"})[0] == 200
    status, info = routes.handle("GET", "/weight_info", {}, b"")
    assert status == 200 and info["weight_version"] == "step-42"
    assert routes.handle("GET", "/get_world_size", {}, b"") == (200, {"world_size": 1})
    assert post("/start_weight_update", {}) == (200, {"status": "ok"})  # {} is "no body" too
    status, body = post("/finish_weight_update")  # a round without an update: not published
    assert status == 409 and "applied no update_weights" in body["error"]
    assert post("/update_weights", {"update_info": empty})[0] == 200
    assert post("/finish_weight_update") == (200, {"status": "ok"})
    assert routes.handle("GET", "/weight_info", {}, b"").body["weight_version"] is None


# ---------------------------------------------------------------------- errors and fan-out
@pytest.mark.processes
@pytest.mark.parametrize(
    ("status", "body", "ctype", "expected"),
    [
        (400, b'{"detail": "bad field x"}', "application/json", "bad field x"),  # FastAPI
        (500, b'{"error": {"message": "boom", "type": "InternalError"}}', "application/json",
         "InternalError: boom"),  # OpenAI/vLLM style
        (409, b'{"error": "out of order", "error_type": "ProtocolStateError"}',
         "application/json", "ProtocolStateError: out of order"),  # wtcore
        (409, b'{"error": "x", "error_type": "ProtocolStateError", "status": 409}',
         "application/json", "ProtocolStateError: x"),  # wtcore's ErrorRecord, in full
        (500, b'{"error": "odd", "error_type": "not a class\\n", "status": 500}',
         "application/json", "odd"),  # a record that fails its checks names no class
        (500, b'{"error": "odd", "error_type": "X", "status": "500"}', "application/json",
         "odd"),
        (502, b"upstream down", "text/plain", "upstream down"),
    ],
)  # fmt: skip
def test_server_messages_reach_the_caller(
    recorder: Recorder, status: int, body: bytes, ctype: str, expected: str
) -> None:
    recorder.answer = lambda _r: (status, body, ctype)
    client = HTTPWeightSyncClient(recorder.url, timeout_s=10)
    with client, pytest.raises(ReceiverError) as err:
        client.start_weight_update()
    (failure,) = err.value.failures
    assert failure.receiver == recorder.url and failure.status == status
    # The server's error class is the failure's type (as in process and over Ray).
    kind, _, message = expected.rpartition(": ")
    assert message in failure.message
    assert failure.error_type == (kind or "HTTPStatusError")
    assert f"{recorder.url} [{status}]" in str(err.value)


@pytest.mark.processes
def test_fan_out_is_concurrent_and_names_each_failure() -> None:
    """Both replicas must be in flight at once: each handler waits for the other at a barrier."""
    barrier = threading.Barrier(3, timeout=10)
    gens = [_recorder(), _recorder(), _recorder()]
    recs = [next(g) for g in gens]
    try:

        def meet(status: int) -> Callable[[Recorded], tuple[int, bytes, str]]:
            def answer(_r: Recorded) -> tuple[int, bytes, str]:
                barrier.wait()
                return status, json.dumps({"error": f"said {status}"}).encode(), "application/json"

            return answer

        recs[0].answer, recs[1].answer, recs[2].answer = meet(200), meet(409), meet(500)
        client = HTTPWeightSyncClient([r.url for r in recs], timeout_s=20)
        with client, pytest.raises(ReceiverError) as err:
            client.start_weight_update()
        assert [(f.receiver, f.status) for f in err.value.failures] == [
            (recs[1].url, 409),
            (recs[2].url, 500),
        ]
        assert "failed on 2 of 3 receiver(s)" in str(err.value)
        assert "said 409" in str(err.value) and "said 500" in str(err.value)
    finally:
        for g in gens:
            g.close()


@pytest.mark.parametrize(
    ("urls", "fragment"),
    [
        ([], "at least one URL"),
        (["127.0.0.1:8000"], "base_urls[0]: expected an http:// or https:// URL"),
        (["http://a:1", "http://a:1/"], "base_urls[1]: 'http://a:1' is listed twice"),
    ],
)
def test_bad_base_urls(urls: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        HTTPWeightSyncClient(urls)


@pytest.mark.processes
def test_abort_on_a_receiver_without_the_route_is_skipped(recorder: Recorder) -> None:
    """vLLM has no /abort_weight_update: its 404 means "unsupported here", not a failure."""
    recorder.answer = lambda _r: (404, b'{"detail": "Not Found"}', "application/json")
    with HTTPWeightSyncClient(recorder.url, timeout_s=10) as client:
        client.abort_weight_update("trainer gave up")
    (req,) = recorder.requests
    assert (req.method, req.path) == ("POST", "/abort_weight_update")
    assert json.loads(req.body) == {"reason": "trainer gave up"}
    recorder.answer = lambda _r: (500, b'{"error": "boom"}', "application/json")
    with HTTPWeightSyncClient(recorder.url, timeout_s=10) as client, pytest.raises(ReceiverError):
        client.abort_weight_update()


def test_the_round_id_travels_in_a_header_and_guards_the_round() -> None:
    """``X-Wtcore-Round`` makes the starter the round's owner; the bodies stay vLLM's."""
    worker = WeightSyncWorker("inline", ModuleSink(build_module(mixed_dtype_state(0))))
    routes = ReceiverRoutes(worker)
    owner = {"Content-Type": "application/json", ROUND_HEADER: new_round_id()}
    stranger = {"Content-Type": "application/json", ROUND_HEADER: new_round_id()}
    bare = {"Content-Type": "application/json"}

    def post(path: str, headers: dict[str, str], body: Any = None) -> tuple[int, dict[str, Any]]:
        raw = b"" if body is None else json.dumps(body).encode()
        return tuple(routes.handle("POST", path, headers, raw))  # type: ignore[return-value]

    empty = {"update_info": {"names": [], "dtype_names": [], "shapes": [], "data": ""}}
    assert (
        post("/init_weight_transfer_engine", bare, {"init_info": {"packed_buffer_size_bytes": 64}})[
            0
        ]
        == 200
    )
    assert post("/start_weight_update", owner) == (200, {"status": "ok"})
    for headers in (bare, stranger):
        for path, body in (("/update_weights", empty), ("/finish_weight_update", None)):
            status, answer = post(path, headers, body)
            assert status == 409 and "belongs to another trainer" in answer["error"], answer
            assert owner[ROUND_HEADER] not in answer["error"]  # the id is never echoed
    status, answer = post("/update_weights", {**bare, ROUND_HEADER: "bad id"}, empty)
    assert status == 400 and "round_id" in answer["error"]
    assert worker.weight_info()["state"] == "updating"
    assert post("/update_weights", owner, empty)[0] == 200
    assert post("/finish_weight_update", owner, {"weight_version": "mine"})[0] == 200
    assert worker.weight_info()["weight_version"] == "mine"
