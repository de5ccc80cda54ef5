"""``wtcore check``: checksum, reset, sync, compare, against real ``wtcore serve`` processes.

The sync is a real trainer process (``inline`` over HTTP) sending the served model's own
weights: after a reset only a sync that writes every weight restores every checksum. One that
leaves a tensor out is caught, naming the tensor and the receiver.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Any

import pytest
import requests

from wtcore.testing.sources import synthetic_state

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

SIZE, TENSORS, SEED = 32 << 10, 5, 3
SYNC = f"""
import sys
from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
state = synthetic_state({SIZE}, {TENSORS}, "float32", seed={SEED})
skip = sys.argv[2] if len(sys.argv) > 2 else None
state = {{n: t for i, (n, t) in enumerate(state.items()) if str(i) != skip}}
info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=1 << 20)
with HTTPWeightSyncClient(sys.argv[1].split(","), timeout_s=60) as client:
    with WeightTransferTrainerFactory.trainer_init(info, client=client, source=TensorSource(state)) as t:
        t.send_weights(weight_version="synced")
"""


def _check(urls: list[str], *sync_args: str) -> subprocess.CompletedProcess[str]:
    sync = shlex.join([sys.executable, "-c", SYNC, ",".join(urls), *sync_args])
    cmd = [sys.executable, "-m", "wtcore.cli", "check", *urls, "--sync", sync]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_check_round_trip(start_server: Any) -> None:
    args = ("--size", str(SIZE), "--tensors", str(TENSORS), "--seed", str(SEED))
    servers = [start_server("--rank", str(r), "--world-size", "2", *args) for r in range(2)]
    urls = [s.url for s in servers]
    done = _check(urls)
    assert done.returncode == 0, done.stdout + done.stderr
    n = len(synthetic_state(SIZE, TENSORS, "float32", seed=SEED))  # its tensors, norms too
    assert done.stdout.splitlines() == [f"{u}: match ({n} tensors)" for u in urls]
    # A sync that leaves the second tensor out: it stays zero, and the check names it.
    done = _check(urls, "1")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(f"MISMATCH in 1 of {n} tensors" in ln for ln in lines)
    second = list(synthetic_state(SIZE, TENSORS, "float32", seed=SEED))[1]
    assert all(f"({second})" in ln for ln in lines)
    # The partial sync was a complete round of what it announced: its version is published,
    # but after the reset the tensor it left out is zeros, so the weights are not consistent.
    for url in urls:
        info = requests.get(f"{url}/weight_info", timeout=30).json()
        assert (info["weight_version"], info["consistent"]) == ("synced", False)
    # A round that writes every tensor makes them consistent again.
    subprocess.run([sys.executable, "-c", SYNC, ",".join(urls)], check=True, timeout=240)
    for url in urls:
        info = requests.get(f"{url}/weight_info", timeout=30).json()
        assert (info["weight_version"], info["consistent"]) == ("synced", True)


def test_a_failing_sync_command_is_exit_2(start_server: Any) -> None:
    server = start_server("--size", str(SIZE), "--tensors", str(TENSORS))
    cmd = [sys.executable, "-m", "wtcore.cli", "check", server.url, "--sync", "exit 3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "exited 3" in done.stderr

    info = requests.get(f"{server.url}/weight_info", timeout=30).json()
    assert info["consistent"] is False  # zeroed and never synced: no version is claimed
    r = requests.post(f"{server.url}/weight_checker", json={"action": "compare"}, timeout=30)
    assert r.status_code == 400 and "baseline" in r.json()["error"]
    r = requests.post(f"{server.url}/weight_checker", json={"action": "nope"}, timeout=30)
    assert r.status_code == 400 and "action" in r.json()["error"]


def test_check_names_the_tensors_a_server_holds_no_bytes_of() -> None:
    """vLLM's CPU backend, without wtcore's adapter, keeps linear weights packed in its kernels
    and empty parameters behind (digest of no bytes): the check says it cannot see them."""
    from wtcore_http_client.check import _NO_BYTES, _line

    baseline = {"qkv_proj.weight": _NO_BYTES, "norm.weight": "ab12"}
    assert _line("u", baseline, {"match": True}) == (
        "u: match (2 tensors; 1 hold no bytes there, unchecked: qkv_proj.weight)"
    )
    assert _line("u", baseline, {"match": False, "mismatches": ["norm.weight"]}) == (
        "u: MISMATCH in 1 of 2 tensors (norm.weight; 1 hold no bytes there, unchecked: "
        "qkv_proj.weight)"
    )
