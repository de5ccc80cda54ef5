"""The layout a vLLM TP worker reports, from vLLM's real layer classes at TP=2 (two processes
in vLLM's own TP group, ``tp_layers.py``, run with the vLLM venv).

What a trainer plans for each rank (the box of each checkpoint tensor, from the reported
rules) must be exactly the region of vLLM's parameter the adapter copies it into (a fused
layer's shard at its offset), for KV heads split over the ranks and held whole by each; a
vocabulary vLLM pads and splits otherwise than torch's rule is refused, naming the layer. The
end-to-end round is ``test_vllm_sharded.py``.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm.vllm_kit import HERE, VLLM_PYTHON

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, dict[str, object]]]:
    out = subprocess.run(
        [str(VLLM_PYTHON), str(HERE / "tp_layers.py")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got: list[dict[str, dict[str, object]]] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def test_each_planned_box_is_the_region_vllm_holds(ranks) -> None:  # type: ignore[no-untyped-def]
    for rank, report in enumerate(ranks):
        for case in ("kv1", "kv2"):
            for name, t in report[case]["targets"].items():  # type: ignore[attr-defined]
                extents = [b - a for a, b in t["box"]]
                assert extents == t["region"], (rank, case, name, t)


def test_kinds_offsets_and_boxes(ranks) -> None:  # type: ignore[no-untyped-def]
    r0, r1 = ranks[0]["kv1"]["targets"], ranks[1]["kv1"]["targets"]  # type: ignore[index]
    got = {n: (t["kind"], t["offset"], t["rows"]) for n, t in r1.items() if ".0." in n}
    assert got == {  # the fused layers' own names are not checkpoint names
        **{
            f"layers.0.{sub}.{p}": (kind, offset, 32)
            for p in ("weight", "bias")
            for sub, kind, offset in (
                ("q_proj", "column", 0),
                ("k_proj", "replicated", 32),  # one KV head: each rank holds it whole
                ("v_proj", "replicated", 64),
            )
        },
        "layers.0.gate_proj.weight": ("column", 0, 64),
        "layers.0.up_proj.weight": ("column", 64, 64),
        "layers.0.down_proj.weight": ("row", None, None),
        "layers.0.down_proj.bias": ("row", None, None),  # whole on each rank (its box)
        "layers.0.norm.weight": ("replicated", None, None),
    }, got
    assert r0["layers.1.q_proj.weight"]["box"] == [[0, 32], [0, 64]]
    assert r1["layers.1.q_proj.weight"]["box"] == [[32, 64], [0, 64]]
    assert r1["layers.1.k_proj.weight"]["box"] == [[0, 32], [0, 64]]
    assert r1["layers.1.down_proj.weight"]["box"] == [[0, 64], [64, 128]]
    assert r1["layers.1.down_proj.bias"]["box"] == [[0, 64]]
    assert r1["embed_tokens.weight"]["box"] == [[128, 256], [0, 64]]
    kv2 = ranks[1]["kv2"]["targets"]  # type: ignore[index]
    assert kv2["layers.0.k_proj.weight"]["kind"] == "column"  # two KV heads: one each
    assert kv2["layers.0.k_proj.weight"]["box"] == [[32, 64], [0, 64]]
    # the rules wildcard the layer index: a few per model, whatever its depth
    assert ["layers.*.q_proj.weight", "column"] in ranks[0]["kv1"]["rules"]  # type: ignore[operator]


def test_a_padded_vocabulary_is_refused_naming_the_layer(ranks) -> None:  # type: ignore[no-untyped-def]
    for rank, report in enumerate(ranks):
        message = str(report["vocab200"])
        assert "'embed_tokens' (VocabParallelEmbedding)" in message, message
        assert "pads the vocabulary of 200 rows to 256" in message, message
        assert f"TP rank {rank}" in message, message


def test_the_worker_method_has_one_name_in_both_distributions() -> None:
    # wtcore-http-client and wtcore-vllm import neither the other (docs/writing-an-engine.md)
    from wtcore_http_client.vllm_workers import WORKER_INFO_METHOD
    from wtcore_vllm.extension import RPC_METHOD, WtcoreWorkerExtension

    assert WORKER_INFO_METHOD == RPC_METHOD
    assert callable(getattr(WtcoreWorkerExtension, RPC_METHOD))
