"""``wtcore bench`` for every engine x client combination, as real processes.

Each run starts its own receivers (in-process, ``wtcore serve`` processes, or Ray actors),
syncs a few MiB for two rounds, verifies every receiver bit for bit through digests, and must
leave no process and no shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

WTCORE = str(Path(sys.executable).with_name("wtcore"))
BACKENDS = ["inline", "nccl", "tcp", "ipc", "mooncake"]
CLIENTS = ["inproc", "http", "ray"]


def _ours_in_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("wtcore", "wtcore-bench"))}


def _marked(marker: str) -> set[int]:
    """PIDs whose environment carries ``marker``: the bench and everything it started."""
    needle = f"WTCORE_TEST_MARKER={marker}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.add(int(entry))
            except OSError:
                pass
    return found


def _wait_none_marked(marker: str, timeout_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_combination(backend: str, client: str, tmp_path: Path) -> None:
    if client == "ray":
        pytest.importorskip("ray")
    shm_before = _ours_in_shm()
    marker = uuid.uuid4().hex
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [WTCORE, "bench", "--backend", backend, "--client", client, "--receivers", "2",
         "--size", "2MiB", "--tensors", "30", "--rounds", "2", "--buffer-size", "256KiB",
         "--baselines", "none", "--timeout", "120", "--json", str(out_json)],
        capture_output=True, text=True, timeout=280,
        env={**os.environ, "WTCORE_TEST_MARKER": marker},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out_json.read_text())
    assert record["ok"] is True
    rounds = record["runs"][0]["rounds"]
    assert len(rounds) == 2 and all(r["verified"] for r in rounds)
    assert all(r["mismatched_tensors"] == [0, 0] for r in rounds)
    if backend == "ipc":  # the default: the model moves into shared memory, one announcement
        assert all(r["num_buckets"] == 1 for r in rounds)
        assert rounds[1]["phases"]["pack"] == 0, "nothing packed once round 0 moved it"
    else:  # the 256 KiB buffer splits every round into buckets
        assert all(r["num_buckets"] > 1 for r in rounds)
    assert _ours_in_shm() <= shm_before
    assert _wait_none_marked(marker) == set()  # every process the bench started has stopped
