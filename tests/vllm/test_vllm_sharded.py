"""A sharded trainer into a real vLLM server: FSDP2 over two trainer processes, no all-gather
anywhere, into TP=1 (M -> 1) and TP=2 (M -> 2).

Server A serves checkpoint A with ``wtcore_tcp``: each trainer rank streams its own shards to it.
Two trainer processes (``sharded_trainer.py``) each hold a ``Shard(0)`` of every tensor of
checkpoint B (``fully_shard`` over a gloo mesh) and send only their own shards; the server
assembles whole tensors. Generation must equal the reference server of B exactly (token ids
and logprobs), and every weight must be bit-equal to it; then the same back to A. Each rank
must have sent exactly its planned bytes, and the ranks together the model once.

M -> 2: server A serves checkpoint A with ``tensor_parallel_size=2`` (vLLM CPU, each worker
bound to a core of its own by ``VLLM_CPU_OMP_THREADS_BIND``), and the reference serves B with
TP=2 too, so that both run the same arithmetic (TP=2 sums partial products across the
workers, which need not round as TP=1 does). Each TP worker reports the
layout derived from its own model (through ``/collective_rpc``, :mod:`wtcore_vllm.extension`)
and gets only its slice: the bytes each receiver planned and landed equal its slice of the
checkpoint, computed here from the layout it reported, and each trainer rank sent exactly
its FSDP shard's overlap with every receiver's slice. Generation and weights must equal the
reference exactly. It needs 2 CPU cores (one per TP worker; vLLM's CPU backend binds each
worker's threads to its own cores) and runs wherever there are.

A model whose vocabulary vLLM pads before splitting it (200 rows, 128 + 128 at TP=2) is
served all the same: each worker reports why it takes no sharded rounds, a sharded round is
refused naming the layer, and a whole-tensor round loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vllm.conftest import Checkpoint, make_checkpoints
from tests.vllm.vllm_kit import HERE, MAIN_PYTHON, VLLMServer, generate, servers
from wtcore.sharded.layout import Layout, Shard, volume
from wtcore.sharded.receiver_layout import TPLayout
from wtcore.testing import torchrun
from wtcore_http_client import VLLMWeightSyncClient

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


#: vLLM's CPU backend binds each TP worker's OpenMP threads to cores of its own.
TP2_CORES = 2


def sharded_sync(
    server: VLLMServer, state: Path, version: str, *extra: str, tp: int = 1
) -> list[dict[str, int]]:
    ranks = _sharded_round(server, state, version, *extra, tp=tp)
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]


def _sharded_round(server: VLLMServer, state: Path, version: str, *extra: str, tp: int) -> Any:
    cmd = [MAIN_PYTHON, str(HERE / "sharded_trainer.py"), "--url", server.url]
    cmd += ["--state", str(state), "--version", version, "--tp", str(tp), *extra]
    server.post("/pause")
    try:
        return torchrun(cmd, 1 if "--whole" in extra else 2, timeout_s=300)
    finally:
        server.post("/resume")


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


def _tp2_options() -> tuple[list[str], dict[str, str]]:
    """vLLM's options and env for a TP=2 server with the worker extension; skips the test
    where the machine has too few cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < TP2_CORES:
        pytest.skip(
            f"vLLM CPU with tensor_parallel_size=2 binds each worker to its own core: needs "
            f"{TP2_CORES} CPU cores, this machine gives {len(cores)}"
        )
    extra = ["--tensor-parallel-size", "2"]
    extra += ["--worker-extension-cls", "wtcore_vllm.extension.WtcoreWorkerExtension"]
    return extra, {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores[:TP2_CORES])}


@pytest.fixture(scope="module")
def tp2_servers(
    checkpoints: tuple[Checkpoint, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """A (``wtcore_tcp``, the worker extension) and the reference B, both TP=2 (the
    reference runs the extension and the adapter too, unused: one set of options for both, and
    checksums of the packed weights on both)."""
    extra, env = _tp2_options()
    a, b = checkpoints
    logs = tmp_path_factory.mktemp("vllm-tp2-logs")
    specs = [(a.dir, logs / "a-tp2.log", "wtcore_tcp"), (b.dir, logs / "ref-tp2.log", "wtcore_tcp")]
    with servers(specs, extra=extra, env=env) as started:
        yield started[0], started[1]


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    """Elements in the intersection of boxes ``a`` and ``b``."""
    return volume(
        tuple(
            (max(x0, y0), max(max(x0, y0), min(x1, y1)))
            for (x0, x1), (y0, y1) in zip(a, b, strict=True)
        )
    )


def test_fsdp2_trainer_syncs_vllm_tp2_each_worker_its_slice(  # type: ignore[no-untyped-def]
    tp2_servers, checkpoints
) -> None:
    server, ref = tp2_servers
    ckpt_a, ckpt_b = checkpoints
    client = VLLMWeightSyncClient(server.url, timeout_s=60)
    try:
        reports = client.weight_info()
        assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
        layouts = [TPLayout.from_wire(r["layout"]) for r in reports]
        assert [(lay.tp_rank, lay.tp_size) for lay in layouts] == [(0, 2), (1, 2)]
        kinds = {
            n: layouts[0].kind(n)
            for n in (
                "model.embed_tokens.weight",
                "lm_head.weight",
                "model.layers.1.self_attn.q_proj.weight",
                "model.layers.1.self_attn.k_proj.weight",  # 1 KV head: each worker holds it
                "model.layers.1.self_attn.o_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
                "model.norm.weight",
            )
        }
        assert list(kinds.values()) == [
            "vocab",
            "vocab",
            "column",
            "replicated",
            "row",
            "column",
            "row",
            "replicated",
        ]

        state = torch.load(ckpt_b.state, weights_only=True)
        model_bytes = sum(t.nbytes for t in state.values())
        slices = [sum(lay.local(n, t).nbytes for n, t in state.items()) for lay in layouts]
        assert all(0 < s < model_bytes for s in slices)
        # each trainer rank's FSDP shard (Shard(0) over 2 ranks) against each receiver's box
        planned = [0, 0]
        for name, t in state.items():
            fsdp = Layout.placed(t.shape, (2,), (Shard(0),))
            for rank in (0, 1):
                src = fsdp.boxes[rank]
                assert src is not None
                for lay in layouts:
                    planned[rank] += _overlap(src, lay.box(name, tuple(t.shape))) * t.element_size()

        original, original_sums = generate(server), server.checksums()
        reference = generate(ref)
        assert original != reference
        stats = sorted(sharded_sync(server, ckpt_b.state, "tp2-1", tp=2), key=lambda r: r["rank"])
        assert [r["rank"] for r in stats] == [0, 1]
        for r in stats:
            assert r["sent"] == r["planned"] == planned[r["rank"]], (r, planned)
        assert sum(r["sent"] for r in stats) == sum(slices)  # every receiver its slice, once
        after = client.weight_info()
        for r, want in zip(after, slices, strict=True):
            assert r["round_bytes"] == {"planned": want, "landed": want}, (r, slices)
        assert server.weight_version() == "tp2-1"
        assert generate(server) == reference  # token ids and logprobs, exactly
        assert server.checksums() == ref.checksums()  # every weight of both workers

        # A layer that gets only some of its slices (k_proj left out: q and v land in the
        # fused qkv_proj) fails the round naming it; vLLM's finalize would otherwise process
        # it from uninitialized memory. Both workers fail it (both hold part of qkv_proj), one
        # error names each; nothing is published, and the server keeps serving.
        omit = "model.layers.1.self_attn.k_proj.weight"
        ranks = _sharded_round(server, ckpt_a.state, "partial", "--omit", omit, tp=2)
        assert any(r.returncode != 0 for r in ranks)
        out = "".join(r.stdout + r.stderr for r in ranks)
        failed = "'model.layers.1.self_attn.qkv_proj' got only part of their tensors"
        assert "finish_weight_update failed on 2 of 2 workers" in out, out[-3000:]
        assert f"TP rank 0: TransferError: layers {failed}" in out, out[-3000:]
        assert f"TP rank 1: TransferError: layers {failed}" in out, out[-3000:]
        assert server.weight_version() == "tp2-1"
        assert len(generate(server)) == len(original)
        # Only the last worker raised (the adapter's _agree): vLLM 0.32's executor reads the
        # workers' replies in rank order and stops at the first failed one, so a failure on
        # every worker would leave the others' replies queued and every later call a reply
        # behind. The server takes the next round at once, and it is exact.
        sharded_sync(server, ckpt_a.state, "tp2-2", tp=2)
        assert generate(server) == original
        assert server.checksums() == original_sums  # the partial round's slices too
        # Whole tensors (ModuleSource, no plan) still work: vLLM's loaders narrow them.
        sharded_sync(server, ckpt_b.state, "tp2-whole", "--whole", tp=2)
        assert generate(server) == reference
        # A staged sharded round: each worker stages its slices, copies them in at the commit.
        sharded_sync(server, ckpt_a.state, "tp2-3", "--staged", tp=2)
        assert generate(server) == original
        assert server.checksums() == original_sums
        for r, want in zip(client.weight_info(), slices, strict=True):
            assert r["round_bytes"] == {"planned": want, "landed": want}, (r, slices)
        for t in client.weight_info():  # each worker's times, through the worker extension
            assert t["paused_s"] >= t["commit_s"] > 0 and t["staged_s"] > 0, t
    finally:
        client.close()


@pytest.fixture(scope="module")
def padded_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, Checkpoint]]:
    """A TP=2 server (``wtcore_tcp``) of a model whose vocabulary of 200 rows vLLM pads to
    256 before splitting it 128 + 128, and a second checkpoint of that model."""
    extra, env = _tp2_options()
    a, b = make_checkpoints(
        tmp_path_factory.mktemp("ckpt-padded"), ("5", "6"), tied=False, vocab=200
    )
    logs = tmp_path_factory.mktemp("vllm-padded-logs")
    with servers([(a.dir, logs / "padded.log", "wtcore_tcp")], extra=extra, env=env) as started:
        yield started[0], b


def test_a_padded_vocabulary_refuses_sharded_rounds_and_takes_whole_ones(padded_tp2) -> None:  # type: ignore[no-untyped-def]
    server, ckpt = padded_tp2
    client = VLLMWeightSyncClient(server.url, timeout_s=60)
    try:
        reports = client.weight_info()
    finally:
        client.close()
    layer = "'model.embed_tokens' (VocabParallelEmbedding)"
    for r in reports:  # the server started; each worker says why it takes no sharded rounds
        assert r["layout"] is None, r
        assert f"{layer}: vLLM pads the vocabulary of 200 rows to 256" in r["layout_error"], r
    ranks = _sharded_round(server, ckpt.state, "sharded", tp=2)
    assert any(r.returncode != 0 for r in ranks)
    out = "".join(r.stdout + r.stderr for r in ranks)
    assert "update_weights failed on 2 of 2 workers" in out, out[-3000:]
    assert "takes no sharded rounds" in out and layer in out, out[-3000:]
    assert server.weight_version() != "sharded"

    before = server.checksums()
    sharded_sync(server, ckpt.state, "whole", "--whole", tp=2)  # vLLM's loaders narrow them
    assert server.weight_version() == "whole"
    after = server.checksums()
    embeds = [k for k in after if k.endswith(":model.embed_tokens.weight")]
    assert len(embeds) == 2 and all(after[k] != before[k] for k in embeds), (before, after)
