"""The nccl engine (gloo) over HTTP across namespaced nodes: trainer on node 0, receivers on 1..3.

Each node has only its own address and resolves its host name to loopback (as in many
containers), so this is the setup where gloo's default device used to advertise ``127.0.0.1``
and the handshake failed with ``Connection refused``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.multinode.mn_kit import API_KEY, MASTER_PORT, Driver, Receiver, start_receivers
from wtcore.digest import digest_named
from wtcore.testing.sources import synthetic_state
from wtcore_bench.netns import Cluster

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

SIZE, TENSORS = 256 << 10, 8
ARGS = ["--backend", "nccl", "--backend-options", '{"torch_num_threads": 1}',
        "--size", str(SIZE), "--tensors", str(TENSORS)]  # fmt: skip


def digest(seed: int) -> str:
    return digest_named(synthetic_state(SIZE, TENSORS, "float32", seed=seed).items())


@pytest.fixture(scope="module")
def net(make_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    c: Cluster = make_cluster(4)
    # node 3 names its interface explicitly, the others find the address that routes to node 0
    tmp = tmp_path_factory.mktemp("receivers")
    receivers = start_receivers(c.nodes[1:3], ARGS, tmp, world_size=3)
    receivers += start_receivers([c[3]], ARGS, tmp, first_rank=2, world_size=3,
                                 GLOO_SOCKET_IFNAME="eth0")  # fmt: skip
    yield c, receivers


def init_cmd(c: Cluster, receivers: list[Receiver], port: int) -> dict[str, Any]:
    return {
        "urls": [r.url for r in receivers], "api_key": API_KEY,
        "master_address": c[0].address, "master_port": port,
        "world_size": len(receivers) + 1, "timeout": 20.0, "size": SIZE, "tensors": TENSORS,
    }  # fmt: skip


def test_node_resolves_its_hostname_to_loopback_but_gloo_binds_the_routed_address(net: Any) -> None:
    c, _ = net
    code = (
        "import socket; from wtcore_nccl.group import gloo_devices as g; "
        f"print(socket.gethostbyname(socket.gethostname())); print(g('{c[0].address}', 1)); "
        f"print(g('{c[0].address}', 1, {{'GLOO_SOCKET_IFNAME': 'eth0'}}))"
    )
    r = c[1].run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("127."), lines
    assert lines[1] == f"[GlooDevice(interface=None, hostname='{c[1].address}')]"
    assert lines[2] == "[GlooDevice(interface='eth0', hostname=None)]"
    # No route at all (a documentation address, nothing routes there): a clear error.
    code = "from wtcore_nccl.group import route_source; route_source('192.0.2.1', 1)"
    r = c[1].run([sys.executable, "-c", code])
    assert "no route from this host to master_address '192.0.2.1'" in r.stderr
    assert "GLOO_SOCKET_IFNAME" in r.stderr


def test_rounds_across_nodes_are_bit_exact(net: Any) -> None:
    """The trainer and two receivers find their routed address; the third names eth0."""
    c, receivers = net
    driver = Driver(c[0])
    try:
        driver.ok("init", **init_cmd(c, receivers, MASTER_PORT))
        for seed in (1, 2, 3):
            driver.ok("send", seed=seed, version=f"v{seed}")
            got = driver.ok("checksums")["checksums"]
            assert got == [digest(seed)] * len(receivers)
        infos = driver.ok("info")["infos"]
        assert [(i["weight_version"], i["consistent"]) for i in infos] == [("v3", True)] * 3
        driver.ok("close")
    finally:
        driver.stop()
