"""wtcore engines inside a real vLLM server (CPU), driven by a wtcore trainer over HTTP.

Server A serves checkpoint A with ``--weight-transfer-config '{"backend": "wtcore_nccl"}'``; the
reference server serves checkpoint B. The trainer (this venv, no vLLM) is wtcore's ``nccl``
trainer engine over gloo with ``HTTPWeightSyncClient``. Buckets are 64 KiB, so one round spans
several buckets and the receiver reuses its two buffers, which is what the adapter's copying
sink guards against. Each round is bracketed by ``/pause`` and ``/resume`` (which clears the
prefix cache, or cached KV from the old weights would be reused).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.vllm.vllm_kit import (
    VLLM_PYTHON,
    VLLMServer,
    generate,
    run_trainer,
    start_trainer,
    stop_process,
)

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def sync(server: VLLMServer, state: Path, version: str) -> None:
    server.post("/pause")
    try:
        stats = run_trainer(server.url, state, version)
    finally:
        server.post("/resume")
    assert stats["num_tensors"] == 21  # 2 layers x 9 + embed, norm, lm_head


def test_plugin_registers_every_wtcore_engine_once() -> None:
    """In vLLM's own venv: ``wtcore_<name>`` for each engine; a second call adds nothing."""
    code = (
        "import json\n"
        "from wtcore.registry import ENGINES\n"
        "from wtcore_vllm.plugin import register\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "first, second = register(), register()\n"
        "names = [*ENGINES.names(), *ENGINES.renamed]\n"
        "print(json.dumps([names, first, second, sorted(F._registry)]))\n"
    )
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=180, check=True
    )
    import json

    engines, first, second, registry = json.loads(out.stdout.strip().splitlines()[-1])
    assert "nccl" in engines and "local" in engines  # local: inline's old name, until 0.3
    assert sorted(first) == sorted(f"wtcore_{e}" for e in engines)
    assert second == []
    assert {"nccl", "wtcore_nccl"} <= set(registry)  # vLLM's own nccl is untouched


def test_sync_into_vllm_matches_reference_then_syncs_back(vllm_servers) -> None:  # type: ignore[no-untyped-def]
    s = vllm_servers
    sync(s.a, s.ckpt_b.state, "step-1")
    assert s.a.weight_version() == "step-1"
    assert generate(s.a) == s.reference  # token ids and logprobs, exactly
    assert s.a.checksums() == s.ref.checksums()  # every (kernel-format) weight, bit for bit

    sync(s.a, s.ckpt_a.state, "step-2")
    assert s.a.weight_version() == "step-2"
    assert generate(s.a) == s.original


def test_killed_trainer_leaves_server_ready_for_a_fresh_round(  # type: ignore[no-untyped-def]
    vllm_servers, tmp_path
) -> None:
    s = vllm_servers
    before_version = s.a.weight_version()
    log_start = s.a.log_path.stat().st_size

    s.a.post("/pause")
    ready = tmp_path / "stalled"
    trainer = start_trainer(
        s.a.url, s.ckpt_b.state, "never", "--stall-after", "12", "--ready-file", str(ready)
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert trainer.poll() is None, "the trainer exited before stalling"
            assert time.monotonic() < deadline, "the trainer never reached mid-round"
            time.sleep(0.2)
    finally:
        stop_process(trainer, timeout_s=0)  # SIGTERM then SIGKILL, mid-round
    # The server's update_weights fails (the sender is gone); wait for it to say so.
    deadline = time.monotonic() + 120
    failure = ""
    while "collective_rpc method failed" not in failure:
        assert time.monotonic() < deadline, "server never reported the failed round"
        time.sleep(0.5)
        with s.a.log_path.open("rb") as f:
            f.seek(log_start)
            failure = f.read().decode(errors="replace")
    assert "receive of bucket" in failure  # the wtcore nccl worker's error, passed through
    s.a.post("/resume")

    assert s.a.weight_version() == before_version  # nothing published
    assert len(generate(s.a)) == len(s.original)  # still serving (some layers old, some new)

    sync(s.a, s.ckpt_b.state, "step-3")
    assert s.a.weight_version() == "step-3"
    assert generate(s.a) == s.reference
    sync(s.a, s.ckpt_a.state, "step-4")
    assert generate(s.a) == s.original


def test_round_missing_a_layer_fails_and_publishes_nothing(vllm_servers) -> None:  # type: ignore[no-untyped-def]
    """A layer that got none of its tensors fails the round, naming it; nothing is published.

    vLLM's layerwise reload only logs "Failed to load weights" for such a layer and puts its
    old weights back, so the round would otherwise be published as complete.
    """
    s = vllm_servers
    before_version = s.a.weight_version()
    missing = "model.layers.1.post_attention_layernorm.weight"
    s.a.post("/pause")
    try:
        out = run_trainer(s.a.url, s.ckpt_b.state, "partial", "--omit", missing, expect_ok=False)
    finally:
        s.a.post("/resume")
    assert "model.layers.1.post_attention_layernorm" in out  # the layer, named to the trainer
    assert s.a.weight_version() == before_version
    assert len(generate(s.a)) == len(s.original)  # still serving

    sync(s.a, s.ckpt_b.state, "step-5")  # the server accepts a fresh round at once
    assert generate(s.a) == s.reference
    sync(s.a, s.ckpt_a.state, "step-6")
    assert generate(s.a) == s.original


def test_bad_init_info_is_rejected_naming_the_field(vllm_servers) -> None:  # type: ignore[no-untyped-def]
    """wtcore's parsing runs inside vLLM: the error names the field; the server keeps serving."""
    s = vllm_servers
    r = requests.post(
        s.a.url + "/init_weight_transfer_engine",
        json={"init_info": {"master_address": "127.0.0.1", "master_port": "x"}},
        timeout=60,
    )
    assert r.status_code >= 400
    assert "init_info.master_port: expected int, got str 'x'" in r.text
    assert len(generate(s.a)) == len(s.original)
