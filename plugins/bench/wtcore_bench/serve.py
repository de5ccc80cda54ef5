"""Start ``wtcore serve`` as a child process, read its URL, and always stop it by PID
(``wtcore bench --client http`` and the tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from wtcore.errors import TransferError
from wtcore.testing.procs import stop_processes
from wtcore_http_client.commands import LISTENING

__all__ = ["ServeProcess", "launch_serve"]

#: Seconds to wait for the URL line: importing torch on a busy 2-core machine takes a while.
START_TIMEOUT_S = 60.0


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Send ``sig``; kill it if it does not exit in time. Returns its status."""
        stop_processes([self.proc], timeout_s, sig=sig)
        return int(self.proc.returncode)


def launch_serve(
    args: Sequence[str],
    *,
    workdir: str | Path | None = None,
    via_cli: bool = True,
    prefix: Sequence[str] = (),
) -> ServeProcess:
    """Start ``wtcore serve --host 127.0.0.1 --port 0 *args`` and wait for its URL line
    (``prefix``: before the interpreter, e.g. ``ip netns exec <node>``)."""
    base = Path(tempfile.mkdtemp(dir=workdir, prefix="wtcore-serve-"))
    out_path, err_path = base / "stdout", base / "stderr"
    module = ["-m", "wtcore.cli", "serve"] if via_cli else ["-m", "wtcore_http_client.server"]
    # faulthandler: a server that dies of a signal leaves every thread's stack in its stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("WTCORE_API_KEY", None)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [*prefix, sys.executable, *module, "--host", "127.0.0.1", "--port", "0", *args],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    server = ServeProcess(proc, "", out_path, err_path)
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
    raise TransferError(
        f"wtcore serve did not start (status {proc.returncode}):\n{server.output()}"
    )
