"""A sharded trainer into a real vLLM server (CPU, TP=1): FSDP2 over two trainer processes, no
all-gather anywhere (M -> 1).

Server A serves checkpoint A with ``wtcore_tcp``: each trainer rank streams its own shards to it.
Two trainer processes (``sharded_trainer.py``) each hold a ``Shard(0)`` of every tensor of
checkpoint B (``fully_shard`` over a gloo mesh) and send only their own shards; the server
assembles whole tensors. Generation must equal the reference server of B exactly (token ids
and logprobs), and every weight must be bit-equal to it; then the same back to A. Each rank
must have sent exactly its planned bytes, and the ranks together the model once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.vllm.vllm_kit import HERE, MAIN_PYTHON, VLLMServer, generate
from wtcore.testing import torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def sharded_sync(server: VLLMServer, state: Path, version: str) -> list[dict[str, int]]:
    cmd = [MAIN_PYTHON, str(HERE / "sharded_trainer.py"), "--url", server.url]
    cmd += ["--state", str(state), "--version", version]
    server.post("/pause")
    try:
        ranks = torchrun(cmd, 2, timeout_s=300)
    finally:
        server.post("/resume")
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]


def test_fsdp2_trainer_syncs_vllm_without_a_gather(vllm_servers) -> None:  # type: ignore[no-untyped-def]
    s = vllm_servers
    assert s.tcp is not None
    model_bytes = sum(t.nbytes for t in torch.load(s.ckpt_b.state, weights_only=True).values())
    stats = sharded_sync(s.tcp, s.ckpt_b.state, "sharded-1")
    assert sorted(r["rank"] for r in stats) == [0, 1]
    for r in stats:
        assert r["sent"] == r["planned"] > 0, r  # each rank sent exactly its own shards
    assert sum(r["sent"] for r in stats) == model_bytes  # every element once, no gather
    assert s.tcp.weight_version() == "sharded-1"
    assert generate(s.tcp) == s.reference  # token ids and logprobs, exactly
    assert s.tcp.checksums() == s.ref.checksums()  # every weight, bit for bit

    sharded_sync(s.tcp, s.ckpt_a.state, "sharded-2")
    assert generate(s.tcp) == s.original
