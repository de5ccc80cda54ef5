"""Fuzzed requests to every HTTP route of the reference receiver.

In process, through the framework-agnostic :class:`ReceiverRoutes.handle`, against a worker in
each state (uninitialized, idle, mid-round); then a smaller run against one real
``wtcore serve`` process over the network. For client garbage the answer is never a 5xx, the
server never dies, and the weights and the published ``weight_version`` do not change (a
well-formed ``finish`` the fuzzer happens to send may legitimately publish its version).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.digest import digest_named
from wtcore_bench.serve import ServeProcess, launch_serve
from wtcore_http_client.routes import ROUTES, ReceiverRoutes

pytestmark = pytest.mark.timeout(180)

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STATES = ["uninitialized", "idle", "updating"]
MAX_BODY = 1 << 16

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(max_size=16),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=16,
)

_entry = st.fixed_dictionaries(
    {},
    optional={
        "names": st.one_of(st.lists(st.sampled_from(["0.weight", "1.bias", "x", ""])), json_values),
        "dtype_names": st.one_of(
            st.lists(st.sampled_from(["float32", "bfloat16", "complex32", "int64"])), json_values
        ),
        "shapes": st.one_of(st.lists(st.lists(st.integers(-3, 2**40), max_size=3)), json_values),
        "data": st.one_of(st.sampled_from(["", "AAAA", "!!", "AAAAAAAAAAA="]), json_values),
    },
)


def _envelopes() -> st.SearchStrategy[Any]:
    """Bodies shaped like the real ones, with fuzzed insides."""
    return st.one_of(
        st.fixed_dictionaries(
            {
                "init_info": st.one_of(
                    json_values,
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "packed_buffer_size_bytes": st.one_of(
                                st.integers(-5, 2**80), json_values
                            )
                        },
                    ),
                )
            }
        ),
        st.fixed_dictionaries({"update_info": st.one_of(_entry, st.lists(_entry, max_size=3))}),
        st.fixed_dictionaries({}, optional={"weight_version": json_values}),
        st.dictionaries(st.text(max_size=10), json_values, max_size=3),
        json_values,
    )


_bodies = st.one_of(
    st.binary(max_size=200),
    _envelopes().map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"{", b"null", b"NaN", b"[]", b"\xff\xfe", b'{"a":1}' * 3]),
)
_route = st.sampled_from(sorted(ROUTES))
_right = _route.map(lambda p: (ROUTES[p][0], p))  # the route's own method: reaches the worker
_other = st.one_of(
    st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "get"]), _route
    ),
    st.tuples(_route, st.text(max_size=12)).map(lambda t: (ROUTES[t[0]][0], f"{t[0]}?{t[1]}")),
    st.tuples(st.sampled_from(["GET", "POST"]), st.text(max_size=20).map(lambda s: "/" + s)),
)
# 3 in 4 requests use the route's own method, so most of them reach the worker
_target = st.tuples(st.integers(0, 3), _right, _other).map(lambda t: t[2] if t[0] == 0 else t[1])


def _headers(*, ascii_only: bool) -> st.SearchStrategy[dict[str, str]]:
    text = (
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)
        if ascii_only
        else st.text(max_size=20)
    )
    auth = st.one_of(
        text.map(lambda t: f"Bearer {t}"),
        text,
    )
    # 3 in 4 requests are authorized, so most of them reach the worker
    auth = st.tuples(st.integers(0, 3), auth).map(
        lambda t: t[1] if t[0] == 0 else AUTH["Authorization"]
    )
    return st.fixed_dictionaries(
        {"Authorization": auth},
        optional={
            "Content-Type": st.sampled_from(["application/json", "text/plain", "x"]),
            "X-Fuzz": text,
        },
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _worker_in(state: str) -> tuple[WeightSyncWorker, torch.nn.Module]:
    model = _model()
    worker = WeightSyncWorker("inline", ModuleSink(model))
    if state != "uninitialized":
        worker.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 12})
        worker.start_weight_update()
        worker.update_weights({"names": [], "dtype_names": [], "shapes": [], "data": ""})
        worker.finish_weight_update("v0")  # (a round without an update is not published)
    if state == "updating":
        worker.start_weight_update()
    return worker, model


def _check_after(
    before_info: dict[str, Any],
    before_digests: dict[str, str],
    after_info: dict[str, Any],
    after_digests: dict[str, str],
    method: str,
    path: str,
    status: int,
) -> None:
    assert after_digests == before_digests, "a fuzzed request changed the weights"
    published = status == 200 and method.upper() == "POST" and path == "/finish_weight_update"
    if not published:
        assert after_info["weight_version"] == before_info["weight_version"]
        assert after_info["rounds_ok"] == before_info["rounds_ok"]
    if not before_info["consistent"]:
        return
    if after_info["consistent"] is False:
        # only a round that was open can end inconsistent (a refused batch, an abandoning
        # re-init); its weights are unchanged anyway (checked above)
        assert before_info["state"] == "updating" and after_info["state"] == "idle"


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    target=_target,
    headers=_headers(ascii_only=False),
    body=_bodies,
    state=st.sampled_from(STATES),
)
def test_routes_handle_fuzz(
    target: tuple[str, str], headers: dict[str, str], body: bytes, state: str
) -> None:
    method, path = target
    worker, model = _worker_in(state)
    routes = ReceiverRoutes(worker, api_key=KEY, max_body_bytes=MAX_BODY)
    before_info, before_digests = worker.weight_info(), digest_named(model.state_dict().items())
    try:
        pre = routes.precheck(method, path, headers)
        response = pre if pre is not None else routes.handle(method, path, headers, body)
        assert 200 <= response.status < 500, response
        event(f"{state}: {response.status}")
        assert isinstance(response.body, dict)
        json.dumps(response.body)  # the answer is JSON-serializable
        if response.status >= 400:
            assert response.body["status"] == response.status and response.body["error"]
        _check_after(
            before_info,
            before_digests,
            worker.weight_info(),
            digest_named(model.state_dict().items()),
            method,
            path.split("?")[0],
            response.status,
        )
        assert worker.weight_info()["busy"] is None
    finally:
        worker.shutdown()


# ---------------------------------------------------------------------- one real process
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = launch_serve(
        ["--api-key", KEY, "--max-body", str(MAX_BODY), "--size", "4KiB", "--tensors", "4"],
        workdir=tmp_path_factory.mktemp("fuzz-serve"),
    )
    try:
        yield proc
    finally:
        assert proc.stop(timeout_s=10) == 0, proc.output()


def _get(server: ServeProcess, path: str) -> Any:
    r = requests.request(
        "GET" if path == "/weight_info" else "POST", server.url + path, headers=AUTH, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


def _post(server: ServeProcess, path: str, body: Any = None) -> requests.Response:
    return requests.post(server.url + path, json=body, headers=AUTH, timeout=30)


def _put_in(server: ServeProcess, state: str) -> None:
    info = _get(server, "/weight_info")
    if info["state"] == "uninitialized" or (state == "idle" and info["state"] == "updating"):
        assert _post(server, "/init_weight_transfer_engine", {"init_info": {
            "packed_buffer_size_bytes": 4096}}).ok  # fmt: skip
    if state == "updating" and _get(server, "/weight_info")["state"] != "updating":
        assert _post(server, "/start_weight_update").ok


@pytest.mark.processes
@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    target=_target,
    headers=_headers(ascii_only=True),
    body=_bodies,
    state=st.sampled_from(["idle", "updating"]),
)
def test_serve_process_fuzz(
    server: ServeProcess, target: tuple[str, str], headers: dict[str, str], body: bytes, state: str
) -> None:
    method, path = target
    _put_in(server, state)
    before_info, before_digests = _get(server, "/weight_info"), _get(server, "/weight_checksums")
    r = requests.request(method, server.url + path, data=body, headers=headers, timeout=30)
    assert r.status_code < 500, r.text
    assert server.proc.poll() is None, server.output()
    _check_after(
        before_info,
        before_digests,
        _get(server, "/weight_info"),
        _get(server, "/weight_checksums"),
        method,
        path.split("?")[0],
        r.status_code,
    )


@pytest.mark.processes
@pytest.mark.parametrize("method", ["PATCH", "OPTIONS", "HEAD"])
def test_other_standard_methods_get_a_json_405(server: ServeProcess, method: str) -> None:
    """Found by the fuzzer above: the stdlib server answered PATCH, OPTIONS and HEAD with an
    HTML 501; they are now routed like every other method (405, or 404 for no such path)."""
    r = requests.request(method, server.url + "/update_weights", headers=AUTH, timeout=30)
    assert r.status_code == 405, r.text
    if method != "HEAD":
        assert r.json()["error"] == f"/update_weights accepts POST, not {method}"
    r = requests.request(method, server.url + "/nope", headers=AUTH, timeout=30)
    assert r.status_code == 404
    assert _get(server, "/weight_info")["state"] in ("idle", "updating")


# ---------------------------------------------------------------------- hostile JSON (issue 14)
def _update(shape: str) -> bytes:
    return (
        b'{"update_info": {"names": ["0.weight"], "dtype_names": ["float32"], "shapes": ['
        + shape.encode()
        + b'], "data": ""}}'
    )


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        (
            "/update_weights",
            b'{"update_info": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "nested deeper than 32 levels",
        ),
        ("/update_weights", _update("[1" + "0" * 4999 + "]"), "an integer of 5000 digits"),
        ("/update_weights", _update(f"[0, {2**70}]"), "an integer of 22 digits"),
        (
            "/update_weights",
            _update(f"[{2**62}, {2**62}]"),
            "shapes[0]: [4611686018427387904, 4611686018427387904] holds",
        ),
        (
            "/init_weight_transfer_engine",
            b'{"init_info": {"packed_buffer_size_bytes": NaN}}',
            "NaN is not JSON",
        ),
        (
            "/init_weight_transfer_engine",
            b'{"init_info": {"packed_buffer_size_bytes": 1e999}}',
            "overflows a float",
        ),
        (
            "/init_weight_transfer_engine",
            b'{"init_info": {"' + b"k" * 1000 + b'": 1}}',
            "a key of 1000 characters",
        ),
        (
            "/finish_weight_update",
            b'{"weight_version": "' + b"v" * 10_000 + b'"}',
            "weight_version: 10000 characters, over the limit of 256",
        ),
        (
            "/abort_weight_update",
            b'{"reason": "' + b"r" * 5000 + b'"}',
            "reason: 5000 characters, over the limit of 1024",
        ),
    ],
    ids=[
        "deep",
        "digits",
        "shape-2**70",
        "shape-product",
        "nan",
        "1e999",
        "key",
        "version",
        "reason",
    ],
)
def test_hostile_json_is_a_400_naming_the_limit(path: str, body: bytes, fragment: str) -> None:
    worker, model = _worker_in("updating")
    routes = ReceiverRoutes(worker, api_key=KEY, max_body_bytes=64 << 20)
    before = digest_named(model.state_dict().items())
    try:
        response = routes.handle("POST", path, AUTH, body)
        assert response.status == 400, response
        assert fragment in response.body["error"], response.body
        info = worker.weight_info()
        assert info["weight_version"] == "v0" and info["state"] == "updating"
        assert digest_named(model.state_dict().items()) == before
    finally:
        worker.shutdown()
