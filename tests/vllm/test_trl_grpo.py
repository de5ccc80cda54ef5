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

from tests.vllm.vllm_kit import ROOT, VLLM_PYTHON, run_example, run_trainer

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

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
    try:
        text = run_example(cmd)
    finally:
        run_trainer(s.a.url, s.ckpt_a.state, "restored-after-trl")  # A again, for the others
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


FAILING_SYNC = """
import json, sys, torch, wtcore_trl
from wtcore.errors import WtcoreError
from wtcore.testing.net import free_port
cls = wtcore_trl.install(backend="nccl", timeout_s=120.0)
client = cls(base_url=sys.argv[1], group_port=free_port())
client.init_communicator(device="cpu")
bogus = torch.ones(4, 4)
try:
    client.update_named_params([("no.such.weight", "float32", [4, 4])], iter([("no.such.weight", bogus)]))
    print(json.dumps({"raised": None}))
except WtcoreError as e:
    print(json.dumps({"raised": type(e).__name__, "message": str(e)}))
finally:
    client.close_communicator()
"""


def test_a_sync_that_fails_raises_naming_the_server_and_publishes_nothing(vllm_servers) -> None:  # type: ignore[no-untyped-def]
    """TRL's training loop gets wtcore's error, never a silent step over stale weights."""
    s = vllm_servers
    before = s.a.weight_version()
    out = subprocess.run(
        [str(VLLM_PYTHON), "-W", "ignore", "-c", FAILING_SYNC, s.a.url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["raised"] == "ReceiverError", result
    assert result["message"].startswith("update_weights failed on 1 of 1 receiver(s)"), result
    assert f"- {s.a.url} [500]" in result["message"], result  # the server, named
    assert s.a.weight_version() == before  # nothing published
