"""``wtcore bench --nodes N --link-rate R``: receivers on namespaced nodes behind capped links,
since loopback measures CPU, not a network. The bench starts itself again in node 0 of a
:mod:`wtcore_bench.netns` cluster and passes it a :class:`Placement` in :data:`NODES_ENV`.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore_bench.api import BenchNotSupportedError
from wtcore_bench.record import with_deprecated_keys

__all__ = ["NODES_ENV", "NodeSlot", "Placement", "placement", "run_on_nodes"]

#: The environment variable that carries the :class:`Placement` into the trainer's node.
NODES_ENV = "WTCORE_BENCH_NODES"
#: Seconds the whole inner bench may take beyond its own calls' timeouts (imports, spawns).
_SLACK_S = 300.0


@dataclass(frozen=True)
class NodeSlot:
    """One receiver node: the namespace to start a process in and the address it listens on."""

    netns: str
    address: str

    def argv(self, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *command]


@dataclass(frozen=True)
class Placement:
    """Where the inner bench's receivers go; read by launchers with ``places_on_nodes``."""

    trainer_address: str
    nodes: tuple[NodeSlot, ...]
    api_key: str

    def node_for(self, rank: int) -> NodeSlot:
        return self.nodes[rank % len(self.nodes)]

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Placement:
        try:
            raw = json.loads(text)
            return cls(
                str(raw["trainer_address"]),
                tuple(NodeSlot(str(n["netns"]), str(n["address"])) for n in raw["nodes"]),
                str(raw["api_key"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise PayloadError(f"{NODES_ENV}: malformed placement ({e})") from e


def placement() -> Placement | None:
    text = os.environ.get(NODES_ENV)
    return Placement.from_env(text) if text else None


def run_on_nodes(
    argv: Sequence[str],
    *,
    client: str,
    nodes: int,
    receivers: int,
    link_rate: str | None,
    timeout_s: float,
    rounds: int,
) -> dict[str, Any]:
    """Run ``wtcore bench *argv`` (without ``--nodes``, ``--link-rate``, ``--json``, ``--plot``)
    in node 0 of a fresh cluster; return its record with ``link``."""
    from wtcore.registry import CLIENTS
    from wtcore_bench.netns import cluster, rate_bits, unavailable_reason
    from wtcore_bench.support import client_bench

    if nodes < 1:
        raise PayloadError(f"--nodes: expected at least 1, got {nodes}")
    bits = rate_bits(link_rate) if link_rate is not None else None
    if not getattr(client_bench(client, CLIENTS.load(client)).launcher, "places_on_nodes", False):
        raise BenchNotSupportedError(
            f"--nodes: client {client!r} cannot start receivers on other nodes (its bench "
            "launcher does not set places_on_nodes); use a network client such as --client http"
        )
    reason = unavailable_reason()
    if reason is not None:
        raise BenchNotSupportedError(f"--nodes: {reason}")
    with cluster(nodes + 1, rate=link_rate) as c, tempfile.TemporaryDirectory() as tmp:
        where = Placement(
            c[0].address,
            tuple(NodeSlot(n.netns, n.address) for n in c.nodes[1:]),
            secrets.token_hex(16),
        )
        out = Path(tmp) / "record.json"
        env = {**os.environ, NODES_ENV: where.to_env(), "OMP_NUM_THREADS": "1"}
        env.pop("GLOO_SOCKET_IFNAME", None)
        cmd = [sys.executable, "-m", "wtcore.cli", "bench", *argv, "--json", str(out)]
        proc = c[0].popen(cmd, env=env, stdout=subprocess.DEVNULL)
        limit = _SLACK_S + timeout_s * (rounds + 2)
        try:
            proc.wait(limit)
        except subprocess.TimeoutExpired:
            raise TransferTimeoutError(
                f"--nodes: the bench in the trainer's node did not end within {limit:g} s"
            ) from None
        if not out.exists():
            raise TransferError(
                f"--nodes: the bench in the trainer's node ended with status {proc.returncode} "
                "and wrote no record (its error is above)"
            )
        record: dict[str, Any] = json.loads(out.read_text())
    best = float(record.get("best_median_gbps") or 0.0)
    link: dict[str, Any] = {"nodes": nodes, "receivers": receivers, "rate": link_rate}
    if bits is not None:
        cap_gbps = bits / 8 / 1e9
        link.update(cap_gbps=cap_gbps, achieved_fraction=best / cap_gbps)
        record["baselines_gbps"]["link_cap"] = cap_gbps
        record["baseline_labels"]["link_cap"] = f"link cap ({link_rate} per node, each way)"
        record["ratios"]["link_cap"] = best / cap_gbps
        with_deprecated_keys(record)
    record["link"] = link
    return record
