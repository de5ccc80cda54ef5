"""Multinode tests: namespaced nodes (``wtcore_bench.netns``), always torn down.

Every test in this folder is marked ``multinode`` and skips with the reason when the machine
cannot make network namespaces (not root, no iproute2). The helpers live in ``tests.multinode.mn_kit``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wtcore_bench.netns import Cluster, cluster, unavailable_reason

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.multinode)
        if reason is None:
            reason = unavailable_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def make_cluster() -> Iterator[Any]:
    """``make_cluster(n, rate=None)``: one cluster per call, all torn down at module end."""
    made: list[Cluster] = []
    stack: list[Any] = []

    def make(n: int, rate: str | None = None) -> Cluster:
        cm = cluster(n, rate=rate)
        c = cm.__enter__()
        stack.append(cm)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for cm in reversed(stack):
            cm.__exit__(None, None, None)
        left = [p.pid for c in made for node in c.nodes for p in node.procs if p.poll() is None]
        assert not left, f"processes left behind by the cluster: {left}"
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [c.token for c in made if c.token in names], "namespaces left behind"
