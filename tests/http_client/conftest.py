"""Real receiver server processes on 127.0.0.1, always stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from wtcore_http_client.commands import LISTENING

START_TIMEOUT_S = 60.0  # torch import on a busy 2-core machine


@dataclass
class ServerProc:
    """One ``wtcore serve`` process: its URL, its output files, and how to stop it."""

    proc: subprocess.Popen[bytes]
    url: str
    stdout: Path
    stderr: Path
    closed: bool = field(default=False)

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Send ``sig`` to this PID; kill it if it does not exit in time. Returns its status."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # in case a test stopped it
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


def _launch(args: list[str], tmp: Path, *, via_cli: bool) -> ServerProc:
    base = tempfile.mkdtemp(dir=tmp, prefix="serve-")
    out_path, err_path = Path(base) / "stdout", Path(base) / "stderr"
    module = ["-m", "wtcore.cli", "serve"] if via_cli else ["-m", "wtcore_http_client.server"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WTCORE_API_KEY", None)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, *module, "--host", "127.0.0.1", "--port", "0", *args],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    server = ServerProc(proc, "", out_path, err_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        first = server.stdout.read_text().splitlines()
        if first and first[0].startswith(LISTENING):
            server.url = first[0][len(LISTENING) :].strip()
            return server
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not start (status {proc.returncode}):\n{server.output()}")


@pytest.fixture(scope="module")
def start_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProc]]:
    """``start_server(*args, via_cli=False)`` starts a receiver; all are stopped at the end."""
    tmp = tmp_path_factory.mktemp("servers")
    started: list[ServerProc] = []

    def start(*args: str, via_cli: bool = False) -> ServerProc:
        server = _launch(list(args), tmp, via_cli=via_cli)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop(timeout_s=10)
