"""Helpers of the multinode tests: ``wtcore serve`` receivers in nodes, the trainer driver.

Everything runs as real processes inside ``wtcore_bench.netns`` nodes; the pytest process
(in the host's namespace) only starts them, pulls links, and reads the driver's JSON answers.
Every test here is marked ``multinode`` and skips with the reason when the machine cannot make
namespaces (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wtcore.testing.procs import stop_processes
from wtcore_bench.netns import Node

HERE = Path(__file__).resolve().parent
API_KEY = "multinode-test-key"
SERVE_PORT = 8100  # every node has its own network stack, so one port fits all
MASTER_PORT = 29600
START_TIMEOUT_S = 90.0  # importing torch on a loaded 2-core machine


def node_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WTCORE_API_KEY", None)
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.update(extra)
    return env


@dataclass
class Receiver:
    """One ``wtcore serve`` process in a node."""

    node: Node
    proc: subprocess.Popen[bytes]
    url: str
    stdout: Path
    stderr: Path

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()


def start_receivers(
    nodes: list[Node],
    args: list[str],
    workdir: Path,
    *,
    first_rank: int = 0,
    world_size: int | None = None,
    **env: str,
) -> list[Receiver]:
    """``wtcore serve ... --rank i`` on each node, bound to its own address, with an API key.

    Ranks count from ``first_rank``; ``world_size`` (the receivers' count) defaults to
    ``len(nodes)``.
    """
    started = []
    for rank, node in enumerate(nodes, start=first_rank):
        base = workdir / f"{node.name}-{time.monotonic_ns()}"
        base.mkdir(parents=True)
        out, err = base / "stdout", base / "stderr"
        argv = [
            sys.executable, "-m", "wtcore.cli", "serve", "--host", node.address,
            "--port", str(SERVE_PORT), "--api-key", API_KEY, "--rank", str(rank),
            "--world-size", str(world_size or len(nodes)), *args,
        ]  # fmt: skip
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = node.popen(argv, env=node_env(**env), stdout=o, stderr=e,
                              stdin=subprocess.DEVNULL)  # fmt: skip
        started.append(Receiver(node, proc, f"http://{node.address}:{SERVE_PORT}", out, err))
    deadline = time.monotonic() + START_TIMEOUT_S
    for r in started:
        while "listening on" not in r.stdout.read_text():
            if r.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"wtcore serve on {r.node.name} did not start:\n{r.output()}")
            time.sleep(0.05)
    return started


class Driver:
    """The trainer process (``driver.py``) in a node, one JSON command and answer at a time."""

    def __init__(self, node: Node, **env: str) -> None:
        self.node = node
        self.proc = node.popen(
            [sys.executable, str(HERE / "driver.py")],
            env=node_env(**env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._answers: queue.Queue[str] = queue.Queue()
        self._stderr: list[str] = []
        #: Extra fields a test adds to every ``init`` command it sends this trainer.
        self.init_fields: dict[str, Any] = {}
        self._pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._pumps:
            t.start()
        ready = self.answer(START_TIMEOUT_S)
        assert ready.get("ready"), ready

    def _pump(self, stream: Any, answers: bool) -> None:
        for line in stream:
            if answers and line.startswith("{"):
                self._answers.put(line)
            else:
                self._stderr.append(line)

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            return json.loads(self._answers.get(timeout=timeout_s))  # type: ignore[no-any-return]
        except queue.Empty:
            raise AssertionError(
                f"the trainer driver on {self.node.name} gave no answer within {timeout_s} s; "
                f"its stderr:\n{''.join(self._stderr[-40:])}"
            ) from None

    def call(self, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.answer(timeout_s)

    def ok(self, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        got = self.call(op, timeout_s, **fields)
        assert got["ok"], f"{op} failed: {got.get('error_type')}: {got.get('error')}\n{got}"
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
            except (BrokenPipeError, OSError):
                pass
        stop_processes([self.proc], 10.0)
        for t in self._pumps:
            t.join(5)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
