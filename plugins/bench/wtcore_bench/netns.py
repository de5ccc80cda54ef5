"""A cluster of network-namespace "nodes" on one machine, for multi-node tests; always torn down.

A "switch" namespace holds the bridge, so nothing is added to the host's namespace and deleting
the namespaces removes every link. Names carry the creator's PID and a random token, so parallel
runs never collide and a killed run's leftovers are swept by the next. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wtcore.errors import PayloadError, WtcoreError
from wtcore.testing.procs import stop_processes

__all__ = [
    "Cluster",
    "NetnsError",
    "Node",
    "cluster",
    "rate_bits",
    "unavailable_reason",
]

#: Every namespace this module creates starts with this prefix, then ``<pid>x<token>-``.
PREFIX = "wtc"
#: The private subnet the nodes live on (node ``i`` gets host address ``i + 1``).
DEFAULT_SUBNET = "10.213.0.0/24"
#: The interface name inside every node (the same in each, so one ``GLOO_SOCKET_IFNAME`` fits).
IFNAME = "eth0"
#: Bound on every ``ip``/``tc`` command.
CMD_TIMEOUT_S = 30.0
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
_RATE_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_RATE_BYTES = {"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


class NetnsError(WtcoreError, RuntimeError):
    """A host command (``ip``, ``tc``) that builds or changes the cluster failed."""


def unavailable_reason() -> str | None:
    """Why namespaced clusters cannot run here (``None`` when they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network-namespace clusters need root (run the multinode tests as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network-namespace clusters need iproute2's `{tool}` on PATH"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    r = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip() or r.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def rate_bits(rate: str) -> float:
    """``tc``'s rate syntax (``1gbit``, ``100mbit``, ``50mbps``) in bits per second."""
    if not _RATE.match(rate):
        raise PayloadError(f"link rate: expected a tc rate like '1gbit' or '100mbit', got {rate!r}")
    unit = rate.lstrip("0123456789.")
    value = float(rate[: len(rate) - len(unit)])
    return value * (_RATE_BITS.get(unit) or _RATE_BYTES[unit])


def _run(argv: list[str], check: bool) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _ip(*args: str, check: bool = True, netns: str | None = None) -> str:
    return _run(["ip", *(("-n", netns) if netns else ()), *args], check)


def _tc(netns: str, *args: str, check: bool = True) -> None:
    _run(["ip", "netns", "exec", netns, "tc", *args], check)


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _netns_inode(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    return None


def _kill_pids(pids: Sequence[int], timeout_s: float = 5.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            with contextlib.suppress(ChildProcessError, OSError):
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
            if _proc_state(pid) in (None, "Z"):
                break
            time.sleep(0.02)


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _delete_namespaces(names: Sequence[str]) -> None:
    for name in names:
        _kill_pids(_netns_pids(name))
    for name in names:
        _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces left by runs whose process is gone."""
    stale = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{PREFIX}(\d+)x[0-9a-f]+-", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            stale.append(name)
    _delete_namespaces(stale)
    return stale


@dataclass
class Node:
    index: int
    netns: str
    address: str
    cluster: Cluster = field(repr=False)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)
    rate: str | None = None

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def port_name(self) -> str:
        return f"p{self.index}"

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this node; the cluster stops it by PID at teardown."""
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *argv],
            env=dict(os.environ if env is None else env),
            **kwargs,
        )
        self.procs.append(proc)  # `ip netns exec` execs argv, so this PID is argv's
        # Return once it is inside the node (or gone), so that running() and kill_all() see it.
        deadline = time.monotonic() + CMD_TIMEOUT_S
        node = os.stat(f"/run/netns/{self.netns}").st_ino
        while proc.poll() is None and _netns_inode(proc.pid) != node:
            if time.monotonic() > deadline:
                raise WtcoreError(
                    f"node {self.index}: {argv[0]} (pid {proc.pid}) did not enter namespace "
                    f"{self.netns} within {CMD_TIMEOUT_S:g} s"
                )
            time.sleep(0.002)
        return proc

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv],
            env=dict(os.environ if env is None else env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def link_down(self) -> None:
        """Pull this node's cable: the switch-side port goes down, packets to and from it drop."""
        _ip("link", "set", self.port_name, "down", netns=self.cluster.switch)

    def link_up(self) -> None:
        _ip("link", "set", self.port_name, "up", netns=self.cluster.switch)

    def set_rate(self, rate: str | None) -> None:
        """Cap this node's link both ways (``tbf``); ``None`` lifts it."""
        for netns, dev in ((self.netns, IFNAME), (self.cluster.switch, self.port_name)):
            if rate is None:
                _tc(netns, "qdisc", "del", "dev", dev, "root", check=False)
                continue
            # The bucket holds ~10 ms at the rate, and at least a few full GSO packets.
            burst = max(256 << 10, int(rate_bits(rate) / 8 / 100))
            _tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", str(burst), "latency", "100ms")  # fmt: skip
        self.rate = rate

    def kill_all(self) -> list[int]:
        """The node vanishes: SIGKILL every process in it; returns their PIDs."""
        ours = {p.pid for p in self.procs if p.poll() is None}
        pids = sorted(set(_netns_pids(self.netns)) | ours)
        _kill_pids(pids)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        return pids

    def running(self) -> list[int]:
        return [pid for pid in _netns_pids(self.netns) if _proc_state(pid) not in (None, "Z")]


class Cluster:
    """``n`` namespaced nodes on one bridge. Use :func:`cluster` (a context manager)."""

    def __init__(self, n: int, *, subnet: str = DEFAULT_SUBNET, rate: str | None = None) -> None:
        if n < 1:
            raise PayloadError(f"n: expected at least 1 node, got {n}")
        net = ipaddress.ip_network(subnet)
        if n > net.num_addresses - 2:
            raise PayloadError(f"subnet {subnet} has no room for {n} nodes")
        self.token = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.token}-sw"
        self.prefixlen = net.prefixlen
        self.nodes = [
            Node(i, f"{self.token}-n{i}", str(net.network_address + i + 1), self) for i in range(n)
        ]
        self._rate = rate
        self._created: list[str] = []

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def up(self) -> None:
        """Create the switch and every node; undo it all on any failure."""
        try:
            self._add_netns(self.switch)
            _ip("link", "set", "lo", "up", netns=self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            for node in self.nodes:
                self._add_netns(node.netns)
                _ip("link", "add", IFNAME, "netns", node.netns, "type", "veth",
                    "peer", "name", node.port_name, "netns", self.switch)  # fmt: skip
                _ip("addr", "add", f"{node.address}/{self.prefixlen}", "dev", IFNAME,
                    netns=node.netns)  # fmt: skip
                _ip("link", "set", "lo", "up", netns=node.netns)
                _ip("link", "set", IFNAME, "up", netns=node.netns)
                _ip("link", "set", node.port_name, "master", "br0", netns=self.switch)
                _ip("link", "set", node.port_name, "up", netns=self.switch)
                if self._rate is not None:
                    node.set_rate(self._rate)
        except BaseException:
            self.down()
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def down(self) -> None:
        """Stop every process by PID, then delete every namespace."""
        procs = [p for node in self.nodes for p in node.procs]
        with contextlib.suppress(Exception):
            stop_processes(procs, 5.0, sig=signal.SIGTERM)
        _delete_namespaces(sorted(self._created, key=lambda n: n == self.switch))  # nodes first
        self._created.clear()


@contextlib.contextmanager
def cluster(n: int, *, subnet: str = DEFAULT_SUBNET, rate: str | None = None) -> Iterator[Cluster]:
    """``n`` nodes on a bridge, each link optionally capped to ``rate``; torn down on any exit."""
    sweep_stale()
    c = Cluster(n, subnet=subnet, rate=rate)
    c.up()
    try:
        yield c
    finally:
        c.down()
