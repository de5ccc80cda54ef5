"""The Ray driver of the multinode Ray test, run inside node 0: docs/ray.md's recipe, as written.

Argument: a JSON file ``{"address": "ip:port", "nodes": n, "code": python}``.
The driver first waits (bounded) until ``nodes`` Ray nodes are alive, so that the recipe's
``ray.nodes()`` sees the worker nodes, then runs ``code`` (the page's block, addresses already
replaced) as this script's ``__main__``, and prints one JSON line: when the nodes were up, what
the block left in ``placed`` and ``infos``, every actor's checksums, and the digests of the
trainer's ``policy`` after the last round.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray

from wtcore.digest import digest_named

NODES_TIMEOUT_S = 120.0


def wait_for_nodes(address: str, n: int) -> float:
    """Connect, wait until ``n`` nodes are alive, disconnect; returns the wall clock then."""
    deadline = time.monotonic() + NODES_TIMEOUT_S
    ray.init(address=address, log_to_driver=False)
    try:
        while True:
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
            alive = [x["NodeManagerAddress"] for x in nodes if x["Alive"]]
            if len(alive) >= n:
                return time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {alive} of {n} Ray nodes alive after {NODES_TIMEOUT_S} s")
            time.sleep(0.1)
    finally:
        ray.shutdown()


def main() -> None:
    with open(sys.argv[1]) as f:
        cmd = json.load(f)
    up_at = wait_for_nodes(cmd["address"], cmd["nodes"])
    namespace: dict[str, Any] = {"__name__": "__main__"}
    t0 = time.monotonic()
    exec(compile(cmd["code"], "docs/ray.md", "exec"), namespace)
    ran_s = time.monotonic() - t0
    print(
        json.dumps(
            {
                "nodes_up_at": up_at,
                "block_s": ran_s,
                "placed": namespace["placed"],
                "infos": namespace["infos"],
                "sums": namespace["sums"],
                "expected": digest_named(namespace["policy"].named_parameters()),
            }
        ),
        flush=True,
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
