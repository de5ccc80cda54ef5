"""``wtcore bench --trainer-ranks``: sharded rounds and gather-then-broadcast, in turns, from real
FSDP2 trainer processes into real HTTP receiver processes on tcp.

Checks what the record says against the plan (no timing): both modes verified bit-exact, each
trainer rank's sharded bytes exactly its share of the receivers' slices, gather-then-broadcast
sending the whole model to every receiver from rank 0 alone, and clear one-line refusals.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout, Shard
from wtcore.sharded.plan import PlannedRound
from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
from wtcore_bench.sharded import RULES, ShardedBenchOptions, run_sharded_bench
from wtcore_kit.synthetic import synthetic_state

pytestmark = pytest.mark.processes

WTCORE = str(Path(sys.executable).with_name("wtcore"))
SIZE, TENSORS = 4 << 20, 30


def _planned(
    m: int, n: int, tp: bool, size: int = SIZE, tensors: int = TENSORS
) -> tuple[list[int], int]:
    """Each trainer rank's planned bytes, and the model's bytes."""
    state = synthetic_state(size, tensors, dtype="bfloat16", seed=0)
    metas = [ParamMeta.of(k, t) for k, t in state.items()]
    src = {k: Layout.placed(t.shape, (m,), (Shard(0),)) for k, t in state.items()}
    reports = [TPLayout(r, n, RULES) if tp else None for r in range(n)]
    plan = PlannedRound.make(metas, src, receiver_layouts(reports, metas)).plan
    return [plan.nbytes(src=r) for r in range(m)], sum(t.nbytes for t in state.values())


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("backend", "m", "n", "layout", "size", "tensors"),
    [
        ("tcp", 2, 2, "tp", SIZE, TENSORS),
        ("tcp", 2, 1, "replica", SIZE, TENSORS),
        # many small tensors in 8 MiB buckets: regions cut by columns (thousands of short
        # rows) packed by the trainer ranks, in several steps
        ("mooncake", 2, 2, "tp", 8 << 20, 300),
    ],
)
def test_both_modes_verify_and_each_rank_sends_its_planned_bytes(
    backend: str, m: int, n: int, layout: str, size: int, tensors: int
) -> None:
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake is not installed")
    opts = ShardedBenchOptions(
        backend=backend,
        trainer_ranks=m,
        receivers=n,
        layout=layout,
        size_bytes=size,
        num_tensors=tensors,
        rounds=2,
        buffer_size_bytes=1 << 20 if backend == "tcp" else 8 << 20,
        timeout_s=120.0,
    )
    record = run_sharded_bench(opts)
    assert record["ok"] and record["exact"] == {"sharded": True, "gathered": True}, record
    planned, model = _planned(m, n, layout == "tp", size, tensors)
    assert record["sharded"]["sent_per_rank"] == planned
    assert record["gathered"]["sent_per_rank"] == [model * n] + [0] * (m - 1)
    assert len(record["sharded"]["seconds"]) == len(record["gathered"]["seconds"]) == 2
    assert all(v >= 0 for v in record["sharded"]["peak_extra_mib_per_rank"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer-ranks", "0"], "--trainer-ranks must be at least 1"),
        (["--trainer-ranks", "2", "--nodes", "3"], "2 + 2 x 2 = 6"),
        (["--trainer-ranks", "2", "--link-rate", "1gbit"], "--link-rate needs --nodes"),
        (["--trainer-ranks", "2", "--backend", "ipc"], "sharded rounds are benchmarked on tcp"),
    ],
)
def test_the_cli_refuses_in_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [WTCORE, "bench", "--backend", "tcp", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
