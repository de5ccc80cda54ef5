"""The bench table prints every ratio in one format, below and above 1."""

from __future__ import annotations

import io
import re
from typing import Any

from wtcore.stats import PHASES
from wtcore_bench.report import print_table


def _record() -> dict[str, Any]:
    round_ = {
        "seconds": 0.5,
        "gbps": 2.0,
        "phases": dict.fromkeys(PHASES, 0.1),
        "receivers_extra_mib": [1.0, None],
        "trainer_extra_mib": 2.0,
        "verified": True,
        "mismatched_tensors": [],
    }
    return {
        "settings": {
            "backend": "inline",
            "client": "inproc",
            "receivers": 2,
            "model_bytes": 1 << 20,
            "model_tensors": 30,
            "dtype": "float32",
            "rounds": 1,
        },
        "runs": [
            {"buffer_size": None, "rounds": [round_], "median_seconds": 0.5, "median_gbps": 2.0}
        ],
        "baselines_gbps": {"memcpy": 12.5, "file": 0.95, "raw_gloo": 1.0},
        "ratios": {"memcpy": 0.16, "file": 2.1, "raw_gloo": None},
        "baseline_labels": {
            "memcpy": "single-thread memcpy",
            "file": "torch.save + load",
            "raw_gloo": "raw gloo broadcast",
        },
        "ok": True,
    }


def test_ratios_share_one_format() -> None:
    out = io.StringIO()
    print_table(_record(), out)
    text = out.getvalue()
    limits = text.split("measured in this run", 1)[1].splitlines()[1:]
    rows = {line.split()[0]: line.rsplit(None, 1)[-1] for line in limits if line.startswith("  ")}
    assert rows["single-thread"] == "0.16x"
    assert rows["torch.save"] == "2.10x"
    assert rows["raw"] == "-"
    assert "faster" not in text
    assert all(re.fullmatch(r"\d+\.\d\dx|-", v) for v in rows.values())
