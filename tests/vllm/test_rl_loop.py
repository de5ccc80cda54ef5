"""The job itself: a GRPO-style RL loop with vLLM sampling and wtcore syncing every step.

Runs ``examples/rl_loop/run.py`` (with the vLLM venv's Python, since the trainer's policy is
transformers' ``LlamaForCausalLM``) against server A of the session's fixture, which serves
checkpoint A with ``wtcore_nccl``. Each run starts by syncing checkpoint A into the server, so
the order of the tests does not matter. The control run (no sync) goes first, then the synced
run. The thresholds below are calibrated in examples/rl_loop/README.md.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.vllm.vllm_kit import ROOT, VLLM_PYTHON, stop_process

# The first test to use the session's servers also pays for starting them.
pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 15
#: fp32 on CPU: vLLM's kernels and transformers' eager Llama differ by rounding only.
MISMATCH_TOL = 1e-3
#: Mean reward of the last 3 steps minus that of the first 3, synced run.
REWARD_RISE = 0.3
#: The control run's reward may drift by noise, never by this much.
CONTROL_DRIFT = 0.1


def test_rl_loop_learns_with_sync_and_drifts_without(vllm_servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = vllm_servers
    log_path = tmp_path / "rl.json"
    cmd = [str(VLLM_PYTHON), str(ROOT / "examples" / "rl_loop" / "run.py")]
    cmd += ["--url", s.a.url, "--checkpoint", str(s.ckpt_a.dir), "--steps", str(STEPS)]
    cmd += ["--json", str(log_path), "--no-progress"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=480)
    finally:
        stop_process(proc, timeout_s=5)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    runs = json.loads(log_path.read_text())["runs"]
    synced, control = runs["synced"]["steps"], runs["control"]["steps"]
    assert len(synced) == len(control) == STEPS
    lines = re.findall(rf"^(control|synced) +step +\d+/{STEPS} ", text, flags=re.M)
    assert lines == ["control"] * STEPS + ["synced"] * STEPS, text[-4000:]  # a line per step

    def rise(steps: list[dict]) -> float:  # type: ignore[type-arg]
        return sum(r["reward"] for r in steps[-3:]) / 3 - sum(r["reward"] for r in steps[:3]) / 3

    # Synced: vLLM serves every step's weights, samples from them, and agrees on their logprobs.
    for rec in synced:
        assert rec["vllm_version"] == str(rec["step"])
        assert rec["mismatch_max"] < MISMATCH_TOL, rec
    assert rise(synced) > REWARD_RISE, [r["reward"] for r in synced]

    # Control: vLLM keeps the initial weights (version 0); the trainer's copy moves away.
    assert all(rec["vllm_version"] == "0" for rec in control)
    assert control[0]["mismatch_max"] < MISMATCH_TOL  # same weights before the first update
    for rec in control[1:]:
        assert rec["mismatch_mean"] > MISMATCH_TOL, rec
    assert abs(rise(control)) < CONTROL_DRIFT, [r["reward"] for r in control]
