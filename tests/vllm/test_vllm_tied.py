"""A tied-embedding model inside a real vLLM server, synced from what a trainer naturally sends.

The tiny Qwen2 here (q/k/v biases, the family of Qwen2.5-0.5B and 1.5B) has
``tie_word_embeddings=True``: its output layer is its input embedding.
The trainer sends ``ModuleSource(model)`` of transformers' model, i.e. ``named_parameters()``,
which yields the shared tensor once, as ``model.embed_tokens.weight``, and no
``lm_head.weight`` (exactly like the checkpoint). vLLM's layerwise reload gives each layer
tensors of its own, so without the adapter's care the output layer would keep its old (on CPU,
prepacked) weights while every route answers 200. Its vocabulary (300 rows) is one vLLM pads
(to 320), so the input embedding is complete only at the end of the round. The reference server
serves checkpoint B; A is served three times, on ``wtcore_nccl``, ``wtcore_ipc`` and
``wtcore_mooncake``, and synced A -> B -> A on each.

The checksums (``/weight_checker``) cover every weight the kernels compute with: on CPU the
adapter reads each linear layer's packed weight, and the output layer's packed copy (a key of
its own, ``lm_head.weight``), back through the kernel (``wtcore_vllm.checker``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.vllm_kit import VLLM_PYTHON, VLLMServer, generate, run_trainer

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def sync_module(server: VLLMServer, model_dir: Path, version: str, backend: str) -> None:
    server.post("/pause")
    try:
        stats = run_trainer(
            server.url,
            None,
            version,
            "--hf-model",
            str(model_dir),
            "--backend",
            backend,
            python=str(VLLM_PYTHON),
        )
    finally:
        server.post("/resume")
    assert stats["num_tensors"] == 26  # 2 layers x 12 (q/k/v biases) + embed + norm: tied once


@pytest.mark.parametrize("backend", ["nccl", "ipc", "mooncake"])
def test_tied_model_syncs_exactly_from_module_source(tied_servers, backend: str) -> None:  # type: ignore[no-untyped-def]
    s = tied_servers
    server = {"nccl": s.a, "ipc": s.ipc, "mooncake": s.mooncake}[backend]
    before = server.checksums()
    sync_module(server, s.ckpt_b.dir, f"tied-1-{backend}", backend)
    assert server.weight_version() == f"tied-1-{backend}"
    assert generate(server) == s.reference  # the output layer too: token ids and logprobs
    after = server.checksums()
    assert after == s.ref.checksums()
    # embed, head, norm, and per layer qkv (weight, bias), o, gate_up, down and 2 norms
    assert len(after) == 17
    # Every checksum follows its weights: all changed but the norms' (ones in A and B alike).
    same = {k for k in after if after[k] == before[k]}
    assert same == {k for k in after if k.endswith("norm.weight")}, sorted(same)

    sync_module(server, s.ckpt_a.dir, f"tied-2-{backend}", backend)
    assert server.weight_version() == f"tied-2-{backend}"
    assert generate(server) == s.original


def test_wtcore_check_round_trip_on_a_vllm_server(tied_servers) -> None:  # type: ignore[no-untyped-def]
    """``wtcore check``: vLLM's own ``/weight_checker`` (checksum, reset), a real sync from
    ``ModuleSource`` through the ``wtcore_nccl`` backend, then compare: every weight written.
    The reset reaches every weight the kernels use (each checksum changes), packed ones too."""
    import shlex
    import subprocess

    from tests.vllm.vllm_kit import MAIN_PYTHON, trainer_cmd

    s = tied_servers
    sync = shlex.join(
        trainer_cmd(
            s.a.url, None, "checked", "--hf-model", str(s.ckpt_a.dir), python=str(VLLM_PYTHON)
        )
    )
    cmd = [MAIN_PYTHON, "-m", "wtcore.cli", "check", s.a.url, "--sync", sync]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == f"{s.a.url}: match (17 tensors)"  # none unchecked
    assert s.a.weight_version() == "checked"
    assert generate(s.a) == s.original  # A's weights again, the output layer too

    base = s.a.checksums()
    s.a.post("/weight_checker", {"action": "reset"})
    zeroed = s.a.checksums()
    assert sorted(k for k in base if zeroed[k] == base[k]) == []
    sync_module(s.a, s.ckpt_a.dir, "restored", "nccl")
    assert s.a.checksums() == base
    assert generate(s.a) == s.original
