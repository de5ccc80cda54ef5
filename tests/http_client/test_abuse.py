"""A real ``wtcore serve`` process under abuse from raw sockets (issue 14, items 1, 2, 4, 6).

Each test talks to the server the way a hostile peer would (hand-written requests on raw
sockets), then checks what matters: the exact refusal, the server process's resident memory
(read from /proc), that it closes what it should close in time, and that a legitimate trainer
still completes a round, bit-exact, while the abuse goes on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import pytest

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.synthetic import synthetic_state

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

KEY = "abuse-key"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
CAP = 12
LIMITS = (
    "--max-connections", str(CAP),
    "--idle-timeout", "3",
    "--header-timeout", "2",
    "--body-timeout", "3",
)  # fmt: skip
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server("--api-key", KEY, "--size", "1MiB", "--seed", "0", *LIMITS)


def _addr(server: Any) -> tuple[str, int]:
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _connect(server: Any, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(_addr(server), timeout=timeout)


def _exchange(server: Any, request: bytes, timeout: float = 20.0) -> str:
    """Send ``request`` and read until the server closes (every refusal closes)."""
    with _connect(server, timeout) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _closed_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``s`` (reads return nothing); fails past ``seconds``."""
    start = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open over {seconds} s") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def _health_ok(server: Any) -> bool:
    answer = _exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return answer.startswith("HTTP/1.1 200")


def test_duplicate_content_length_is_refused_before_any_allocation(server: Any) -> None:
    before = _rss(server.pid)
    answer = _exchange(
        server,
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Length: {256 * MIB}\r\nContent-Length: 0\r\n\r\n".encode(),
    )
    assert answer.startswith("HTTP/1.1 400"), answer
    assert "Content-Length: sent more than once" in answer
    assert _rss(server.pid) - before < 32 * MIB
    assert _health_ok(server)


@pytest.mark.parametrize(
    ("request_text", "status", "fragment"),
    [
        (  # one reader took 10 from this, another refused it
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n" + AUTH
            + b"Content-Length: 1_0\r\n\r\n{}        ",
            400, "Content-Length: expected 1 to 18 ASCII digits, got '1_0'",
        ),
        (
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n" + AUTH
            + b"Transfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}",
            400, "both Transfer-Encoding and Content-Length",
        ),
        (
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n" + AUTH
            + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            411, "send a Content-Length",
        ),
        (  # which one would win is the ambiguity
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            + AUTH + b"Content-Length: 0\r\n\r\n",
            400, "Authorization: sent more than once",
        ),
        (
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n" + AUTH
            + b"Content-Length : 2\r\n\r\n{}",
            400, "a malformed header line",
        ),
        (b"GARBAGE\r\n\r\n", 400, '"error": "Bad request syntax'),  # JSON, with a status line
        (  # obsolete line folding: one header or two?
            b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n" + AUTH
            + b"X-Folded: a\r\n Content-Length: 2\r\nContent-Length: 0\r\n\r\n",
            400, "line folding",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
            400, "GET /health takes no body",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(90)) + b"\r\n",
            431, "Line too long",
        ),
    ],
    ids=["garbage", "cl-underscore", "te-and-cl", "chunked", "two-auth", "space-colon", "folded", "get-body", "huge-headers"],
)  # fmt: skip
def test_ambiguous_or_oversized_requests_are_refused(
    server: Any, request_text: bytes, status: int, fragment: str
) -> None:
    answer = _exchange(server, request_text)
    assert answer.startswith(f"HTTP/1.1 {status}"), answer
    assert fragment in answer, answer
    assert "Connection: close" in answer
    info = HTTPWeightSyncClient(server.url, api_key=KEY, timeout_s=30).weight_info()[0]
    assert info["state"] != "updating"  # nothing reached the worker


def test_unauthenticated_callers_learn_no_routes(server: Any) -> None:
    for request in (
        b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /weight_info HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        b"DELETE /update_weights HTTP/1.1\r\nHost: x\r\n\r\n",
    ):
        answer = _exchange(server, request)
        assert answer.startswith("HTTP/1.1 401"), answer
        assert "/update_weights" not in answer.split("\r\n\r\n", 1)[1]
    answer = _exchange(server, b"GET /nope HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    assert answer.startswith("HTTP/1.1 404") and "/update_weights" not in answer


def test_idle_and_slow_peers_are_cut_and_the_cap_answers_503(server: Any) -> None:
    with ExitStack() as stack:
        idle = [stack.enter_context(_connect(server)) for _ in range(CAP)]
        time.sleep(0.5)  # the server accepts them one by one
        extra = _exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", timeout=10)
        assert extra.startswith("HTTP/1.1 503"), extra
        assert f"too many connections (the limit is {CAP})" in extra
        # --idle-timeout 3: every idle connection is closed by the server.
        for s in idle:
            assert _closed_within(s, 15) < 15
    assert _health_ok(server)
    # A slow-loris peer: one header line every 0.5 s, forever. --header-timeout 2 cuts it.
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        s.settimeout(0.5)
        try:
            while time.monotonic() - start < 15:
                s.sendall(b"X-Slow: 1\r\n")
                try:
                    if s.recv(65536) == b"":
                        break
                except TimeoutError:
                    continue
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - start < 8, "the server never cut the slow headers"


def test_stalled_bodies_hold_no_memory_and_a_trainer_still_syncs(server: Any) -> None:
    before = _rss(server.pid)
    with ExitStack() as stack:
        stalled = []
        for _ in range(8):  # authenticated updates declaring 64 MiB each, then nothing
            s = stack.enter_context(_connect(server))
            s.sendall(
                b"POST /update_weights HTTP/1.1\r\nHost: x\r\n" + AUTH
                + f"Content-Length: {64 * MIB}\r\n\r\n".encode()
                + b'{"update_info": '
            )  # fmt: skip
            stalled.append(s)
        time.sleep(1.0)  # the server has read their headers and waits for the bodies
        # 8 x 64 MiB declared: with pre-allocation the server would hold 512 MiB more.
        assert _rss(server.pid) - before < 64 * MIB
        state = synthetic_state(MIB, 30, "float32", seed=1)
        with HTTPWeightSyncClient(server.url, api_key=KEY, timeout_s=60) as client:
            engine = WeightTransferTrainerFactory.trainer_init(
                InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=256 << 10), client=client
            )
            engine.send_weights(TensorSource(state), weight_version="during-abuse", verify=True)
            assert client.checksums() == [digest_named(state.items())]
            info = client.weight_info()[0]
            assert info["weight_version"] == "during-abuse" and info["consistent"] is True
            engine.shutdown()
        for s in stalled:  # --body-timeout 3 ends each of them
            assert _closed_within(s, 15) < 15
    assert server.proc.poll() is None


def test_an_empty_api_key_is_a_one_line_error() -> None:
    env = {**os.environ, "WTCORE_API_KEY": ""}
    done = subprocess.run(
        [sys.executable, "-m", "wtcore.cli", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "wtcore serve: error: --api-key (or WTCORE_API_KEY) is empty: set a key, or unset it "
        "to run without authentication on a loopback address"
    ]
