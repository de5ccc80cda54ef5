"""Ray across nodes: docs/ray.md's multi-node recipe, run as written on namespaced nodes.

A Ray head on node 0 and Ray worker nodes on nodes 1 and 2 are started with the page's own
``ray start`` lines (the harness's addresses, a fresh token, and test-only options: a short
temp dir per node, a small object store, ``--block`` so that each ``ray start`` stays the
parent of its node's daemons). The driver in node 0 then runs the page's Python block: two
nccl-engine (gloo) receivers as Ray actors pinned to nodes 1 and 2, three verified rounds.

This Ray cluster is separate from the session's local one (tests/ray_client): its processes
live in the nodes' namespaces, so its ports cannot clash, and its temp dirs are its own.
``ray stop`` is never run (it kills every Ray process on the machine): teardown stops the
``ray start --block`` processes by PID, then the harness kills whatever is left in each node's
namespace (all of it started here) and deletes the namespaces.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multinode.mn_kit import node_env
from wtcore.testing.procs import stop_processes
from wtcore_bench.netns import Cluster

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[1] / "docs" / "ray.md"
RAY = str(Path(sys.executable).with_name("ray"))
#: The page's addresses, in node order.
DOC_ADDRESSES = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
#: Test-only options: per-node temp dirs, a small object store, and a foreground ``ray start``.
TEST_OPTIONS = ["--object-store-memory", str(100 << 20), "--disable-usage-stats", "--block"]
START_TIMEOUT_S = 120.0


def page_blocks(lang: str) -> list[str]:
    """The ``lang`` fenced blocks of docs/ray.md's "Multi node" section."""
    text = PAGE.read_text()
    section = text[text.index("## Multi node\n") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"^```{lang}\n(.*?)^```$", section, flags=re.M | re.S)


def localize(text: str, c: Cluster) -> str:
    for doc, node in zip(DOC_ADDRESSES, c.nodes, strict=False):
        text = text.replace(doc, node.address)
    return text


def ray_start_lines(c: Cluster) -> tuple[list[str], list[str]]:
    """The page's head and worker ``ray start`` argv (env assignments dropped), localized."""
    [block] = page_blocks("sh")
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    argvs = []
    for line in lines:
        argv = shlex.split(localize(line, c))
        while re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            argv.pop(0)
        assert argv[:2] == ["ray", "start"], line
        argvs.append(argv[2:])
    [head] = [a for a in argvs if "--head" in a]
    [worker] = [a for a in argvs if "--address" in a]
    return head, worker


@pytest.fixture(scope="module")
def ray_nodes(make_cluster: Any) -> Iterator[tuple[Cluster, dict[str, str], float, Path]]:
    """Three nodes running one Ray cluster; yields it, the env, the start time, the logs."""
    c: Cluster = make_cluster(3)
    # Unix socket paths must stay short (Ray's limit is ~107 bytes), so not under tmp_path.
    root = Path(tempfile.mkdtemp(prefix="wtray", dir="/tmp"))
    env = node_env(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
    )
    head, worker = ray_start_lines(c)
    t0 = time.time()
    try:
        for node in c.nodes:
            argv = head if node.index == 0 else worker
            if node.index > 1:  # the page shows node 1's line; node 2 uses its own address
                argv = [node.address if a == c[1].address else a for a in argv]
            tmp = root / f"n{node.index}"
            tmp.mkdir()
            with open(root / f"n{node.index}.log", "wb") as log:
                node.popen([RAY, "start", *argv, "--temp-dir", str(tmp), *TEST_OPTIONS],
                           env=env, stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)  # fmt: skip
            if node.index == 0:
                _wait_started(root / "n0.log", node.procs[-1])
        yield c, env, t0, root
    finally:
        # SIGTERM each `ray start --block`: it stops its own daemons.
        stop_processes([p for node in c.nodes for p in node.procs], 20.0, sig=signal.SIGTERM)
        # Anything left in the nodes (workers mid-exit) is killed with the namespaces.
        shutil.rmtree(root, ignore_errors=True)


def _wait_started(log: Path, proc: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def test_ray_cluster_across_nodes_runs_the_recipe_bit_exact(ray_nodes: Any) -> None:
    c, env, t0, root = ray_nodes
    [code] = page_blocks("python")
    cmd = {
        "address": localize("10.0.0.1:6380", c),
        "nodes": len(c.nodes),
        "code": localize(code, c),
    }
    assert "10.0.0.1:6380" in code and cmd["address"] in cmd["code"], "the page's head address"
    (root / "cmd.json").write_text(json.dumps(cmd))
    r = c[0].run([sys.executable, str(HERE / "ray_driver.py"), str(root / "cmd.json")],
                 env=env, timeout_s=200)  # fmt: skip
    logs = "".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("*.log")))
    assert r.returncode == 0, f"driver failed:\n{r.stderr[-6000:]}\n{logs}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    start_s = got["nodes_up_at"] - t0
    print(f"Ray cluster of 3 nodes up in {start_s:.1f} s; recipe ran in {got['block_s']:.1f} s")
    # The receivers sit on nodes 1 and 2, as placed by per_actor_options.
    assert [p["node_ip"] for p in got["placed"]] == [c[1].address, c[2].address]
    assert [(i["weight_version"], i["consistent"]) for i in got["infos"]] == [("step-2", True)] * 2
    # Bit-exact: every actor holds exactly the trainer's last round (CRC-32 of every tensor's
    # bytes; the rounds themselves ran with verify=True).
    assert got["sums"] == [got["expected"]] * 2
    assert start_s < START_TIMEOUT_S
