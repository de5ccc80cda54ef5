"""The harness itself: nodes reach each other, links go down and up, teardown always happens."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wtcore_bench.netns import cluster, rate_bits

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

CONNECT = "import socket; socket.create_connection(('{0}', {1}), timeout=2).close(); print('ok')"
LISTEN = "import socket; s = socket.create_server(('{0}', {1})); s.settimeout(30); s.accept()"


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_rate_syntax() -> None:
    assert rate_bits("1gbit") == 1e9 and rate_bits("20mbit") == 2e7 and rate_bits("1mbps") == 8e6
    with pytest.raises(ValueError, match="expected a tc rate like '1gbit'"):
        rate_bits("fast")


def test_link_down_up_kill_and_teardown_even_on_failure() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), cluster(2, rate="100mbit") as c:
        token = c.token
        a, b = c[0], c[1]
        assert (a.address, b.address) == ("10.213.0.1", "10.213.0.2")
        b.popen([sys.executable, "-c", LISTEN.format(b.address, 7000)])
        for _ in range(100):  # wait for the listener, bounded
            r = a.run([sys.executable, "-c", CONNECT.format(b.address, 7000)], timeout_s=30)
            if r.stdout.strip() == "ok":
                break
        assert r.stdout.strip() == "ok", r.stderr
        b.link_down()
        r = a.run([sys.executable, "-c", CONNECT.format(b.address, 7001)], timeout_s=30)
        assert "timed out" in r.stderr or "unreachable" in r.stderr, r.stderr
        b.link_up()
        sleeper = b.popen(["sleep", "300"])
        assert sleeper.pid in b.running()
        assert sleeper.pid in b.kill_all() and b.running() == []
        a.popen(["sleep", "300"])  # left for the teardown
        raise RuntimeError("the test failed")
    assert token not in namespaces()
    assert all(p.poll() is not None for node in c.nodes for p in node.procs)
