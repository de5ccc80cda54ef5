"""``wtcore bench --backend mooncake``: its limit (a bare ``transfer_sync_read`` of one buffer of
the model's size) moves the bytes it claims, and the engine runs in the bench over HTTP and over
Ray with the limit measured in turns with its rounds, every receiver verified.

Real processes and real transfer engines: the limit's readers are spawned, the bench's
receivers are ``wtcore serve`` processes or Ray actors (a local Ray cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wtcore_bench import BaselineContext
from wtcore_bench.support import find_engine_bench
from wtcore_bench.support import mooncake as mc_bench
from wtcore_kit.synthetic import synthetic_state

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

WTCORE = str(Path(sys.executable).with_name("wtcore"))


def _ctx(receivers: int, nbytes: int = 3 << 20) -> BaselineContext:
    state = synthetic_state(nbytes, 10, "float32", seed=1)
    total = sum(t.numel() * t.element_size() for t in state.values())
    return BaselineContext(state, total, receivers, timeout_s=120)


def test_the_pattern_does_not_repeat_within_a_page() -> None:
    p = mc_bench.pattern(8192)
    assert p.dtype == torch.uint8 and p.numel() == 8192
    assert not torch.equal(p[:4096], p[4096:])


def test_bare_read_reads_the_whole_buffer_into_every_receiver_each_call() -> None:
    ctx = _ctx(receivers=2)
    with mc_bench.bare_read_session(ctx) as read:
        for _ in range(3):
            read()
    # the session's exit checked each receiver: 3 reads, its buffer equal to the sender's


def test_the_bench_finds_the_engine_and_declares_its_limit_with_a_session() -> None:
    from wtcore_mooncake import MooncakeTrainerInitInfo
    from wtcore_mooncake.trainer import MooncakeTrainerEngine

    bench = find_engine_bench("mooncake")
    assert bench is mc_bench.BENCH
    assert bench.baselines["bare_read"].session is mc_bench.bare_read_session
    assert not bench.baselines["bare_read"].peer
    assert bench is not None
    info = bench.init_info(
        MooncakeTrainerEngine,
        receivers=2,
        host="127.0.0.1",
        buffer_size_bytes=1 << 20,
    )
    assert isinstance(info, MooncakeTrainerInitInfo)
    assert (info.address, info.packed_buffer_size_bytes) == ("127.0.0.1", 1 << 20)


@pytest.mark.parametrize("client", ["http", pytest.param("ray", marks=pytest.mark.ray)])
def test_wtcore_bench_runs_mooncake_with_the_limit_in_turns(tmp_path: Path, client: str) -> None:
    out = tmp_path / "bench.json"
    args = ["--backend", "mooncake", "--client", client, "--receivers", "2", "--size", "4MiB"]
    args += ["--tensors", "30", "--rounds", "3", "--interleave", "--json", str(out)]
    proc = subprocess.run([WTCORE, "bench", *args], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["ok"] is True
    assert "bare_read" in record["interleaved"]
    run = record["runs"][0]
    assert run["verified"] is True and len(run["rounds"]) == 3
    assert all("bare_read" in r["baseline_seconds"] for r in run["rounds"])
    assert record["baselines_gbps"]["bare_read"] > 0
    assert record["ratios"]["bare_read"] > 0
    assert "bare transfer_sync_read" in proc.stdout
