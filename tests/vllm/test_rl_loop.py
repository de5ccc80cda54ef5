"""The job itself: a GRPO-style RL loop with vLLM sampling and wtcore syncing every step.

Runs ``examples/rl_loop/run.py`` (with the vLLM venv's Python, since the trainer's policy is
transformers' ``LlamaForCausalLM``) against the session's server of checkpoint A with
``wtcore_nccl`` and wtcore's worker extension (its workers report each round's paused time),
which gets A back afterwards. Each run starts by syncing checkpoint A into the server. The control run (no sync) goes first, then
the synced run, then the async run (the next batch generated while the previous step's weights
are staged), all in one ``run.py``. The thresholds below are calibrated in
examples/rl_loop/README.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.vllm.vllm_kit import ROOT, VLLM_PYTHON, run_example, run_trainer

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 15
#: Every step's batch, in completion tokens: loop.py's 4 prompts x 8 samples x 16 tokens.
BATCH_TOKENS = 4 * 8 * 16
#: fp32 on CPU: vLLM's kernels and transformers' eager Llama differ by rounding only.
MISMATCH_TOL = 1e-3
#: Mean reward of the last 3 steps minus that of the first 3, synced and async runs.
REWARD_RISE = 0.3
#: The control run's reward may drift by noise, never by this much.
CONTROL_DRIFT = 0.1


def _run(url: str, ckpt: Path, log_path: Path) -> tuple[str, dict]:  # type: ignore[type-arg]
    cmd = [str(VLLM_PYTHON), str(ROOT / "examples" / "rl_loop" / "run.py")]
    cmd += ["--url", url, "--checkpoint", str(ckpt), "--steps", str(STEPS)]
    cmd += ["--runs", "control,synced,async", "--json", str(log_path), "--no-progress"]
    text = run_example(cmd, timeout_s=480)
    return text, json.loads(log_path.read_text())["runs"]


def test_rl_loop_learns_with_sync_and_drifts_without(vllm_servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = vllm_servers
    try:
        text, runs = _run(s.a.url, s.ckpt_a.dir, tmp_path / "rl.json")
    finally:  # A again, and no KV cached under the loop's weights, for the others
        run_trainer(s.a.url, s.ckpt_a.state, "restored-after-rl")
        assert s.a.post("/reset_prefix_cache") == {"success": True}
    synced, control, pipelined = (runs[k]["steps"] for k in ("synced", "control", "async"))
    assert len(synced) == len(control) == len(pipelined) == STEPS
    lines = re.findall(rf"^(control|synced|async) +step +\d+/{STEPS} ", text, flags=re.M)
    assert lines == ["control"] * STEPS + ["synced"] * STEPS + ["async"] * STEPS, text[-4000:]

    def rise(steps: list[dict]) -> float:  # type: ignore[type-arg]
        return sum(r["reward"] for r in steps[-3:]) / 3 - sum(r["reward"] for r in steps[:3]) / 3

    # Synced: vLLM serves every step's weights, samples from them, and agrees on their logprobs;
    # it is paused for the whole classic round.
    for rec in synced:
        assert rec["vllm_version"] == str(rec["step"])
        assert rec["token_versions"] == {str(rec["step"] - 1): BATCH_TOKENS}, rec
        assert rec["mismatch_max"] < MISMATCH_TOL, rec
        assert rec["paused_s"] == rec["sync_s"] > rec["commit_s"] > 0, rec
        assert rec["staged_s"] is None and rec["tokens_in_flight"] == 0, rec
    assert rise(synced) > REWARD_RISE, [r["reward"] for r in synced]
    assert runs["synced"]["final_mismatch_max"] < MISMATCH_TOL

    # Control: vLLM keeps the initial weights (version 0); the trainer's copy moves away.
    assert all(rec["vllm_version"] == "0" for rec in control)
    assert all(rec["token_versions"] == {"0": BATCH_TOKENS} for rec in control), control
    assert control[0]["mismatch_max"] < MISMATCH_TOL  # same weights before the first update
    for rec in control[1:]:
        assert rec["mismatch_mean"] > MISMATCH_TOL, rec
    assert abs(rise(control)) < CONTROL_DRIFT, [r["reward"] for r in control]

    # Async: every sync is a staged round; vLLM is paused for its commit only, generating the
    # next batch meanwhile (one step off-policy: sampled under the version before the last).
    for rec in pipelined:
        s = rec["step"]
        assert rec["vllm_version"] == str(s), rec  # one version per step
        assert set(rec["token_versions"]) <= {str(max(s - 2, 0)), str(s - 1)}, rec
        assert sum(rec["token_versions"].values()) == BATCH_TOKENS, rec
        assert rec["staged_s"] > 0 and rec["sync_s"] > rec["paused_s"] >= rec["commit_s"] > 0, rec
        assert rec["paused_s"] < rec["sync_s"], rec
    assert pipelined[0]["mismatch_max"] < MISMATCH_TOL  # batch 1 came from the trainer's weights
    assert rise(pipelined) > REWARD_RISE, [r["reward"] for r in pipelined]  # off-policy, still
    assert pipelined[-1]["tokens_in_flight"] == 0  # no next batch after the last step
    assert sum(rec["tokens_in_flight"] for rec in pipelined) > 0, pipelined
    # After the last commit vLLM serves exactly the trainer's weights again.
    assert runs["async"]["final_mismatch_max"] < MISMATCH_TOL
