"""TRL's GRPOTrainer against a real vLLM CPU server, syncing through wtcore-trl.

Runs ``examples/trl_grpo/train.py`` with the vLLM venv's Python (TRL lives there, next to
vLLM) against server A of the session's fixture (``wtcore_nccl``). Its ``synced`` run executes
the python block of docs/trl.md as it stands: ``wtcore_trl.install``, a real ``GRPOTrainer``
(the tiny checkpoint A, an in-memory prompt set, a reward anyone can check), then
``wtcore_trl.follow``. Every run starts with a sync of the initial policy at step 0, so the
runs and the tests around them do not depend on what the server held before; the server gets
checkpoint A back at the end.

After every step: the server's ``/weight_info`` version is the step whose weights were synced,
and TRL's own measure of the training-inference mismatch (the trainer's logprobs of vLLM's
sampled tokens against vLLM's) stays within fp32 rounding. The control run syncs step 0 only,
and its mismatch grows. The ``delta`` run is the synced one with ``delta=True``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.vllm.vllm_kit import ROOT, VLLM_PYTHON, run_trainer, stop_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 5
#: fp32 on CPU: vLLM's kernels and transformers' eager Llama differ by rounding only
#: (the RL loop test's tolerance; measured here: at most about 1e-5).
MISMATCH_TOL = 1e-3


def test_grpo_trainer_syncs_every_step_through_wtcore(vllm_servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = vllm_servers
    log_path = tmp_path / "trl.json"
    cmd = [str(VLLM_PYTHON), "-W", "ignore", str(ROOT / "examples" / "trl_grpo" / "train.py")]
    cmd += ["--url", s.a.url, "--checkpoint", str(s.ckpt_a.dir), "--steps", str(STEPS)]
    cmd += ["--json", str(log_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        stop_process(proc, timeout_s=5)
        run_trainer(s.a.url, s.ckpt_a.state, "restored-after-trl")  # A again, for the others
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    runs = json.loads(log_path.read_text())["runs"]
    lines = re.findall(rf"^(control|synced|delta) +step +\d+/{STEPS} ", text, flags=re.M)
    assert lines == ["control"] * STEPS + ["synced"] * STEPS + ["delta"] * STEPS, text[-4000:]

    for name in ("synced", "delta"):
        steps = runs[name]["steps"]
        assert [r["step"] for r in steps] == list(range(STEPS))
        for r in steps:
            assert r["vllm_version"] == str(r["step"]), (name, r)  # global step of the sync
            assert r["syncs"] == r["step"] + 1, (name, r)  # one round per step, none skipped
            assert r["mismatch_max"] < MISMATCH_TOL, (name, r)

    control = runs["control"]["steps"]
    assert all(r["vllm_version"] == "0" and r["syncs"] == 1 for r in control), control
    assert control[0]["mismatch_max"] < MISMATCH_TOL  # the same weights before any update
    drift = [r["mismatch_mean"] for r in control[1:]]
    assert all(d > MISMATCH_TOL for d in drift), drift
    assert drift[-1] > drift[0], drift  # the gap grows as the trainer moves away
