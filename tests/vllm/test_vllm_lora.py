"""LoRA adapter rounds into a real vLLM server (CPU): only the adapter moves, served by name.

One server serves checkpoint A with ``wtcore_nccl``, ``--enable-lora`` and vLLM's filesystem
resolver (``VLLM_LORA_RESOLVER_CACHE_DIR``). A PEFT trainer (``lora_trainer.py``, the vLLM venv)
sends ``LoRASource(model, "policy")``; the same server loads the very adapter PEFT saved,
from its folder, under another name (``/v1/load_lora_adapter``): the two names must generate
the same greedy token ids and logprobs, exactly, and the base model must generate what it did
before any round. The round's bytes are the adapter's, a small part of the merged model's.

The same server carries TRL: ``examples/trl_grpo/train.py --runs lora`` runs docs/trl.md's LoRA
block as it stands, a ``GRPOTrainer`` with a ``peft_config`` whose syncs go through
``wtcore_trl.follow(trainer, lora="policy")``.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import load_file

from tests.vllm.conftest import Checkpoint
from tests.vllm.vllm_kit import (
    HERE,
    ROOT,
    VLLM_PYTHON,
    Outputs,
    VLLMServer,
    generate,
    run_example,
    servers,
    stop_process,
)
from wtcore.testing.net import free_port

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_RANK = 8
#: GRPO steps of the TRL run, and its mismatch tolerance (fp32 rounding, as test_trl_grpo.py).
TRL_STEPS = 3
MISMATCH_TOL = 1e-3


@pytest.fixture(scope="module")
def lora_server(
    checkpoints: tuple[Checkpoint, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VLLMServer, Checkpoint, Path, Outputs]]:
    probe = [str(VLLM_PYTHON), "-c", "import peft"]
    if subprocess.run(probe, capture_output=True, timeout=120).returncode:
        pytest.skip("no PEFT in the vLLM venv: rerun scripts/vllm-venv.sh (remove its stamp)")
    a = checkpoints[0]
    cache = tmp_path_factory.mktemp("lora-cache")
    logs = tmp_path_factory.mktemp("vllm-logs-lora")
    extra = ["--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_LORA_RESOLVER_CACHE_DIR": str(cache)}
    with servers([(a.dir, logs / "lora.log", "wtcore_nccl")], extra=extra, env=env) as started:
        yield started[0], a, cache, generate(started[0])


class PEFTTrainer:
    """``lora_trainer.py`` (the vLLM venv), one process for every round: a round per stdin line,
    its answer a JSON line on stdout, read by a thread so that every wait has a timeout."""

    def __init__(self, server: VLLMServer, a: Checkpoint, log: Path) -> None:
        self.server = server
        cmd = [str(VLLM_PYTHON), str(HERE / "lora_trainer.py"), "--url", server.url]
        cmd += ["--port", str(free_port()), "--model-dir", str(a.dir), "--name", "policy"]
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self._answer() == {"ready": True}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(line)

    def _answer(self) -> Any:
        try:
            return json.loads(self.lines.get(timeout=300))
        except queue.Empty:
            raise TimeoutError(
                f"the PEFT trainer did not answer (exit {self.proc.poll()})"
            ) from None

    def round(self, ref: Path, seed: int, rank: int = 4, targets: str = "q_proj,v_proj") -> Any:
        """One adapter round (PEFT saves the same adapter into ``ref``), between pause and
        resume (which clears the prefix cache, whose KV the old adapter computed)."""
        spec = {"seed": seed, "rank": rank, "targets": targets.split(","), "ref": str(ref)}
        assert self.proc.stdin is not None
        self.server.post("/pause")
        try:
            self.proc.stdin.write(json.dumps({**spec, "version": f"lora-{seed}"}) + "\n")
            self.proc.stdin.flush()
            return self._answer()
        finally:
            self.server.post("/resume")

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # EOF: the trainer shuts its engine down and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        stop_process(self.proc, timeout_s=5)
        self.reader.join(timeout=10)
        self.proc.stdout.close()


def load_from_folder(server: VLLMServer, name: str, path: Path) -> None:
    body = {"lora_name": name, "lora_path": str(path)}
    r = requests.post(server.url + "/v1/load_lora_adapter", json=body, timeout=120)
    assert r.status_code == 200, r.text


def test_adapter_rounds_equal_the_adapter_loaded_from_its_folder(  # type: ignore[no-untyped-def]
    lora_server, tmp_path, request
) -> None:
    server, a, cache, base = lora_server
    trainer = PEFTTrainer(server, a, tmp_path / "trainer.log")
    request.addfinalizer(trainer.close)
    seen: list[Outputs] = [base]
    rounds: list[dict[str, Any]] = [
        {},
        {},
        {"rank": 2, "targets": "q_proj,k_proj,o_proj,down_proj"},
    ]
    for seed, change in enumerate(rounds, 1):  # the third changes the rank and target modules
        ref = tmp_path / f"ref-{seed}"
        stats = trainer.round(ref, seed, **change)
        assert "error" not in stats, stats["error"]
        assert server.weight_version() == f"lora-{seed}"  # vLLM keeps one label: the round's
        # only the adapter moved: PEFT's own tensors, bytes for bytes
        assert stats["num_tensors"] == stats["adapter_tensors"] > 0
        assert stats["num_bytes"] == stats["adapter_bytes"]
        assert stats["num_bytes"] * 10 < stats["merged_bytes"]
        landed = load_file(cache / "policy" / "adapter_model.safetensors")
        saved = load_file(ref / "adapter_model.safetensors")
        assert landed.keys() == saved.keys()
        assert all(torch.equal(landed[n], saved[n]) for n in saved)
        load_from_folder(server, f"ref-{seed}", ref)
        policy = generate(server, "policy")
        assert policy == generate(server, f"ref-{seed}")  # token ids and logprobs, exactly
        assert all(policy != earlier for earlier in seen)  # this round's adapter, not a stale one
        assert generate(server) == base  # the base model is untouched
        seen.append(policy)
    assert generate(server, "ref-1") == seen[1]  # a folder adapter is unaffected by the rounds

    # A rank over the server's --max-lora-rank: vLLM's loader refuses it at the finish, the
    # round fails and the name keeps serving the previous adapter.
    out = trainer.round(tmp_path / "big", 4, rank=2 * MAX_RANK)["error"]
    assert "update_info.wtcore_lora" in out and f"greater than max_lora_rank {MAX_RANK}" in out
    assert generate(server, "policy") == seen[-1]
    assert server.weight_version() == "lora-3"  # nothing published
    assert generate(server) == base


def test_grpo_trainer_with_a_peft_config_syncs_only_its_adapter(  # type: ignore[no-untyped-def]
    lora_server, tmp_path
) -> None:
    """TRL unchanged: every sync is the adapter's bytes, TRL generates with the adapter (its own
    logprobs agree with vLLM's), and after one last sync the server serves, as ``policy``,
    exactly the adapter PEFT saves; the base model is untouched."""
    server, a, cache, base = lora_server
    log_path, saved_dir = tmp_path / "trl.json", tmp_path / "adapter"
    cmd = [str(VLLM_PYTHON), "-W", "ignore", str(ROOT / "examples" / "trl_grpo" / "train.py")]
    cmd += ["--url", server.url, "--checkpoint", str(a.dir), "--steps", str(TRL_STEPS)]
    cmd += ["--runs", "lora", "--json", str(log_path), "--adapter-dir", str(saved_dir)]
    run_example(cmd)

    saved = load_file(saved_dir / "adapter_model.safetensors")
    adapter_bytes = sum(t.nbytes for t in saved.values())
    merged_bytes = sum(t.nbytes for t in load_file(a.dir / "model.safetensors").values())
    steps = json.loads(log_path.read_text())["runs"]["lora"]["steps"]
    assert [r["step"] for r in steps] == list(range(TRL_STEPS))
    for r in steps:
        assert r["vllm_version"] == str(r["step"]) and r["syncs"] == r["step"] + 1, r
        assert r["sync_bytes"] == adapter_bytes < merged_bytes // 10, r  # nothing merged
        assert r["mismatch_max"] < MISMATCH_TOL, r  # vLLM sampled with the trained adapter
    assert server.weight_version() == str(TRL_STEPS)  # the last sync, after the last step

    landed = load_file(cache / "policy" / "adapter_model.safetensors")
    assert landed.keys() == saved.keys()
    assert all(torch.equal(landed[n], saved[n]) for n in saved)
    load_from_folder(server, "grpo-ref", saved_dir)
    policy = generate(server, "policy")
    assert policy == generate(server, "grpo-ref")  # token ids and logprobs, exactly
    assert policy != base  # training moved the adapter
    assert generate(server) == base  # the base model is untouched
