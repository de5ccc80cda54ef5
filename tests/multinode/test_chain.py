"""tcp's relay chain (``topology="chain"``) across namespaced nodes.

Trainer on node 0, ``wtcore serve`` tcp receivers on nodes 1-3 (ranks 1-3): rank 1 takes every
piece from the trainer and relays it to rank 2, which relays it to rank 3. Rounds
are bit-exact; when the relay in the middle vanishes mid-round, every surviving receiver's
round fails within the timeout with an error that names the missing rank, and the next
round, over the surviving nodes after a new init, is bit-exact again. ``wtcore bench
--nodes`` runs here too, since it needs the same namespaces.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.multinode.mn_kit import API_KEY, MASTER_PORT, Driver, Receiver, start_receivers
from wtcore.digest import digest_named
from wtcore.testing.sources import synthetic_state
from wtcore_bench.netns import Cluster

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SIZE, TENSORS = 4 << 20, 16
TIMEOUT_S = 4.0  # the tcp engine's bound on each wait, and the HTTP client's
SLACK_S = 8.0  # fan-out grace, the streams' teardown, a loaded 2-core machine
RATE = "20mbit"  # a chained round (4 MiB over each link once) lasts about 1.7 s
ARGS = ["--backend", "tcp", "--size", str(SIZE), "--tensors", str(TENSORS)]
_ports = itertools.count(MASTER_PORT + 300)


def digest(seed: int) -> str:
    return digest_named(synthetic_state(SIZE, TENSORS, "float32", seed=seed).items())


def init(driver: Driver, c: Cluster, receivers: list[Receiver]) -> None:
    driver.ok(
        "init",
        urls=[r.url for r in receivers], api_key=API_KEY, master_address=c[0].address,
        master_port=next(_ports), world_size=len(receivers) + 1, timeout=TIMEOUT_S,
        size=SIZE, tensors=TENSORS, backend="tcp", topology="chain",
    )  # fmt: skip


def synced(driver: Driver, n: int, seed: int) -> None:
    assert driver.ok("checksums")["checksums"] == [digest(seed)] * n
    infos = driver.ok("info")["infos"]
    assert [(i["weight_version"], i["consistent"]) for i in infos] == [(f"v{seed}", True)] * n


def settled(driver: Driver, indices: list[int]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + TIMEOUT_S + SLACK_S
    while True:
        infos = driver.ok("info")["infos"]
        picked = [infos[i] for i in indices]
        if all("error" not in i and i["busy"] is None for i in picked):
            return picked
        assert time.monotonic() < deadline, f"receivers never settled: {infos}"
        time.sleep(0.2)


def test_chain_across_nodes_and_a_relay_that_vanishes(make_cluster: Any, tmp_path: Path) -> None:
    c: Cluster = make_cluster(4, rate=RATE)
    receivers = start_receivers(c.nodes[1:], ARGS, tmp_path)
    driver = Driver(c[0])
    try:
        init(driver, c, receivers)
        for seed in (1, 2, 3):  # several rounds over one chain
            driver.ok("send", seed=seed, version=f"v{seed}", timeout_s=60)
            synced(driver, 3, seed)

        # The relay in the middle (group rank 2, node 2) vanishes while chunks flow through it.
        init(driver, c, receivers)
        t0 = time.monotonic()
        driver.send("send", seed=99, version="never")
        time.sleep(0.5)
        c[2].kill_all()
        got = driver.answer(TIMEOUT_S + SLACK_S + 10)
        took = time.monotonic() - t0
        assert not got["ok"], got
        assert took < TIMEOUT_S + SLACK_S, (took, got["error"])
        print(f"after {took:.1f} s: {got['error_type']}: {got['error']}")
        before, after = settled(driver, [0, 2])
        # Rank 1 could not hand chunks on to rank 2; rank 3 stopped getting them from it. Which
        # of rank 1's waits notices first depends on timing: a send "to rank 2", or a chunk
        # "not yet taken by rank 2 (the next rank of the chain)" (seen once under CI load).
        assert re.search(r"(to|taken by) rank 2\b", before["last_error"]), before
        assert "from rank 2" in after["last_error"], after
        for info in (before, after):
            assert info["weight_version"] == "v3", info

        # The surviving nodes carry on: node 3's receiver takes the missing rank's place.
        survivor = receivers[0]
        [replacement] = start_receivers([c[3]], [*ARGS, "--port", "8101"], tmp_path,
                                        first_rank=1, world_size=2)  # fmt: skip
        replacement.url = f"http://{c[3].address}:8101"
        init(driver, c, [survivor, replacement])
        driver.ok("send", seed=4, version="v4", timeout_s=60)
        synced(driver, 2, 4)
    finally:
        driver.stop()


def test_bench_on_capped_nodes_reports_the_rate_against_the_cap(tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    r = subprocess.run(
        [sys.executable, "-m", "wtcore.cli", "bench", "--backend", "tcp", "--client", "http",
         "--nodes", "2", "--receivers", "2", "--link-rate", "100mbit", "--size", "2MiB",
         "--tensors", "8", "--dtype", "float32", "--rounds", "1", "--timeout", "60",
         "--engine-option", "topology=chain", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text())
    link = record["link"]
    assert (link["nodes"], link["receivers"], link["rate"]) == (2, 2, "100mbit")
    assert link["cap_gbps"] == pytest.approx(100e6 / 8 / 1e9)
    assert 0 < link["achieved_fraction"] <= 1.05, link
    assert record["settings"]["engine_options"] == {"topology": "chain"}
    assert record["ok"] and "x the cap" in r.stdout, r.stdout
