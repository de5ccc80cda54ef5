"""``wtcore bench --plan-only``: planning a simulated round, no processes.

What the record says is checked against the layouts themselves, not against numbers written
here: a trainer rank sends each element it holds to every receiver whose part holds it (the
trainer's layouts hold each element once), a receiver gets its parts' bytes, and the pairs
and the busiest link are those of the whole plan.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wtcore.sharded.layout import volume
from wtcore.sharded.plan import plan_transfer
from wtcore_bench.plan import plan_layout, run_plan_bench

WTCORE = str(Path(sys.executable).with_name("wtcore"))


def _meet(a: Any, b: Any) -> int:
    """Elements both boxes hold."""
    n = int(a is not None and b is not None)
    for (x, y), (u, v) in zip(a or (), b or (), strict=False):
        n *= max(0, min(y, v) - max(x, u))
    return n


def _check(record: dict[str, Any], layout: str, m: int, n: int) -> None:
    tensors, _ = plan_layout(layout, m, n)
    assert record["ok"] and (record["layout"], record["trainer_ranks"]) == (layout, m)
    assert record["tensors"] == len(tensors) and record["plan_s"] == record["trainer"]["plan_s"]
    sent = sum(2 * _meet(s.boxes[0], d.boxes[r]) for _, s, d in tensors for r in range(n))
    got = sum(2 * volume(d.boxes[0]) for _, _, d in tensors if d.boxes[0] is not None)
    assert (record["trainer"]["bytes"], record["receiver"]["bytes"]) == (sent, got)
    whole = plan_transfer(tensors).select()  # every rank's part
    for side, mine in (("trainer", lambda c: c.src == 0), ("receiver", lambda c: c.dst == 0)):
        links: dict[tuple[int, int], int] = {}
        for c in filter(mine, whole):
            links[(c.src, c.dst)] = links.get((c.src, c.dst), 0) + c.nbytes
        x = record[side]
        assert (x["pairs"], x["busiest_link_bytes"]) == (len(links), max(links.values()))
        assert x["chunks"] == sum(map(mine, whole)) and x["peak_mib"] > 0 and x["cpu_s"] > 0


def test_plan_only_records_one_rank_and_one_receiver_of_the_dense_model(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["--plan-only", "--trainer-ranks", "16", "--receivers", "8", "--json", str(out)]
    proc = subprocess.run([WTCORE, "bench", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "16 trainer ranks -> 8 receivers" in proc.stdout
    _check(json.loads(out.read_text()), "dense", 16, 8)


def test_plan_only_plans_the_moe_model_with_expert_parallel_ranks() -> None:
    _check(run_plan_bench("moe", 16, 8), "moe", 16, 8)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer-ranks", "0"], "--trainer-ranks must be at least 1"),
        (["--plan-layout", "sparse"], "invalid choice: 'sparse'"),
    ],
)
def test_plan_only_refuses_in_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [WTCORE, "bench", "--plan-only", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
