"""Network faults between namespaced nodes: links that go down, a node that vanishes, slow links.

Trainer on node 0, ``wtcore serve`` receivers on nodes 1 and 2, every link capped (``tbf``)
so that a round lasts long enough to be cut in the middle. Each test asserts: the round ends
within the configured timeout (plus slack for a loaded 2-core machine) with an error naming the
receiver's node; every reachable receiver then reports a known state (``consistent``, version,
no call in flight); and the next round (link back, or over the survivors) is bit-exact. The
module's cluster fixture checks that no process or namespace is left behind. Every test runs
four times: over nccl (gloo's collective broadcast), over tcp (its default for two receivers,
the chain: the trainer streams to receiver 1, which relays to receiver 2), over tcp's fan-out
(TCP connections from the trainer to each receiver) and over mooncake (each receiver reads
every bucket from the trainer's registered staging with its own transfer engine).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.multinode.mn_kit import API_KEY, MASTER_PORT, Driver, Receiver, start_receivers
from wtcore.digest import digest_named
from wtcore.testing.sources import synthetic_state
from wtcore_bench.netns import Cluster

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SIZE, TENSORS = 2 << 20, 16
TIMEOUT_S = 4.0  # the engine's bound on each wait, and the HTTP client's
SLACK_S = 8.0  # fan-out grace, gloo's teardown, a loaded 2-core machine
RATE = "20mbit"  # a round (2 x 2 MiB from the trainer) lasts about two seconds
ARGS = {
    "nccl": ["--backend", "nccl", "--backend-options", '{"torch_num_threads": 1}'],
    "tcp": ["--backend", "tcp"],
    "mooncake": ["--backend", "mooncake"],
}
SHAPE = ["--size", str(SIZE), "--tensors", str(TENSORS)]
_ports = itertools.count(MASTER_PORT + 100)


def digest(seed: int) -> str:
    return digest_named(synthetic_state(SIZE, TENSORS, "float32", seed=seed).items())


@pytest.fixture(scope="module", params=["nccl", "tcp", "tcp-fanout", "mooncake"])
def net(
    make_cluster: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Cluster, list[Receiver], Driver]]:
    c: Cluster = make_cluster(3, rate=RATE)
    backend, _, topology = request.param.partition("-")
    args = [*ARGS[backend], *SHAPE]
    receivers = start_receivers(c.nodes[1:], args, tmp_path_factory.mktemp("receivers"))
    driver = Driver(c[0])
    driver.init_fields["backend"] = backend
    if topology:
        driver.init_fields["topology"] = topology
    if request.param == "mooncake":
        # One bucket: mooncake's timeout bounds each bucket's read, so a link that moves every
        # 256 KiB bucket within it (the slow link below) is slow, not stalled, and the round
        # would go on (docs/mooncake.md, "Limits").
        driver.init_fields["buffer_size"] = SIZE
    try:
        yield c, receivers, driver
    finally:
        driver.stop()


def init(driver: Driver, c: Cluster, receivers: list[Receiver]) -> None:
    driver.ok(
        "init",
        urls=[r.url for r in receivers], api_key=API_KEY, master_address=c[0].address,
        master_port=next(_ports), world_size=len(receivers) + 1, timeout=TIMEOUT_S,
        size=SIZE, tensors=TENSORS, **driver.init_fields,
    )  # fmt: skip


def good_round(driver: Driver, c: Cluster, receivers: list[Receiver], seed: int) -> None:
    """A fresh trainer (new group) and one round, bit-exact on every receiver."""
    init(driver, c, receivers)
    driver.ok("send", seed=seed, version=f"v{seed}")
    assert driver.ok("checksums")["checksums"] == [digest(seed)] * len(receivers)
    infos = driver.ok("info")["infos"]
    assert [(i["weight_version"], i["consistent"]) for i in infos] == [(f"v{seed}", True)] * len(
        receivers
    )


def failed_round(
    driver: Driver,
    c: Cluster,
    receivers: list[Receiver],
    fault: Callable[[], None],
    *,
    mid_round: bool = True,
) -> tuple[dict[str, Any], float]:
    """Inject ``fault`` once a round is under way (or just before it); return the answer."""
    init(driver, c, receivers)
    if not mid_round:
        fault()
    t0 = time.monotonic()
    driver.send("send", seed=99, version="never")
    if mid_round:
        time.sleep(0.4)
        fault()
    got = driver.answer(TIMEOUT_S + SLACK_S + 10)
    assert not got["ok"], f"the round survived the fault: {got}"
    print(f"after {time.monotonic() - t0:.1f} s: {got['error_type']}: {got['error']}")
    return got, time.monotonic() - t0


def settled_infos(driver: Driver, n: int) -> list[dict[str, Any]]:
    """Every receiver's ``weight_info`` once no call is in flight on any of them."""
    deadline = time.monotonic() + TIMEOUT_S + SLACK_S
    while True:
        infos = driver.ok("info")["infos"]
        if all("error" not in i and i["busy"] is None for i in infos[:n]):
            return infos
        assert time.monotonic() < deadline, f"receivers never settled: {infos}"
        time.sleep(0.2)


def assert_known_state(infos: list[dict[str, Any]], last: str) -> None:
    """After a failed round: the last good version, honestly flagged if possibly mixed."""
    for info in infos:
        assert info["weight_version"] == last, info
        assert info["consistent"] in (True, False)
        if not info["consistent"]:
            assert info["last_error"], info


def test_slow_link_round_that_fits_the_timeout(net: Any) -> None:
    c, receivers, driver = net
    good_round(driver, c, receivers, seed=1)


def test_slow_link_round_beyond_the_timeout(net: Any) -> None:
    c, receivers, driver = net
    slow = c[1]
    try:
        # 2 MiB at 1 Mbit/s takes about 17 s: far beyond the 4 s timeout
        got, took = failed_round(
            driver, c, receivers, lambda: slow.set_rate("1mbit"), mid_round=False
        )
        assert took < TIMEOUT_S + SLACK_S, took
        assert slow.address in got["error"], got["error"]
        assert "timed out" in got["error"] or "within" in got["error"] or "Timeout" in got["error"]
    finally:
        slow.set_rate(RATE)
    assert_known_state(settled_infos(driver, 2), "v1")
    good_round(driver, c, receivers, seed=2)


def test_receiver_link_down_mid_round_then_back(net: Any) -> None:
    c, receivers, driver = net
    victim = c[1]
    try:
        got, took = failed_round(driver, c, receivers, victim.link_down)
        assert took < TIMEOUT_S + SLACK_S, took
        assert victim.address in got["error"], got["error"]
    finally:
        victim.link_up()
    assert_known_state(settled_infos(driver, 2), "v2")
    good_round(driver, c, receivers, seed=3)


def test_trainer_link_down_mid_round(net: Any) -> None:
    c, receivers, driver = net
    try:
        got, took = failed_round(driver, c, receivers, c[0].link_down)
        assert took < TIMEOUT_S + SLACK_S, took
        assert any(r.node.address in got["error"] for r in receivers), got["error"]
    finally:
        c[0].link_up()
    assert_known_state(settled_infos(driver, 2), "v3")
    good_round(driver, c, receivers, seed=4)


def test_receiver_node_vanishes_mid_round(net: Any) -> None:
    """Last in the module: node 2 stays dead, and the next round runs over the survivor."""
    c, receivers, driver = net
    victim = c[2]
    got, took = failed_round(driver, c, receivers, victim.kill_all)
    assert took < TIMEOUT_S + SLACK_S, took
    assert victim.address in got["error"], got["error"]
    assert victim.running() == []
    [survivor, gone] = settled_infos(driver, 1)
    assert_known_state([survivor], "v4")
    assert gone["error_type"] in ("ReceiverError", "TransferTimeoutError"), gone
    good_round(driver, c, receivers[:1], seed=5)
