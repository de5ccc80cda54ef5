"""``wtcore bench --backend X`` runs any installed engine, bench support declared or not.

The third-party engine is the one of tests/core/test_plugin_upgrade.py, installed the same way
(a package and a ``*.dist-info`` folder, here on the console script's ``PYTHONPATH``): its
distribution declares its engine record and nothing for the bench, so the bench runs it with
the default :class:`~wtcore_bench.EngineBench` (rank 0, the init info's own defaults, the
generic limits) and verifies every round on every receiver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.test_plugin_upgrade import ENGINE_0_2, _install

WTCORE = str(Path(sys.executable).with_name("wtcore"))
NAME = "b64plain"


@pytest.mark.timeout(300)
def test_an_engine_that_declares_only_its_record_runs_in_the_bench(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install(site, NAME, "0.2.0", ENGINE_0_2)
    assert (site / f"wtcore_{NAME}-0.2.0.dist-info" / "entry_points.txt").read_text() == (
        f"[wtcore.backends]\n{NAME} = {NAME}:ENGINE\n\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    env.pop("WTCORE_DISABLE_PLUGIN_AUTOLOAD", None)
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            WTCORE,
            "bench",
            "--backend",
            NAME,
            "--size",
            "256KiB",
            "--tensors",
            "12",
            "--rounds",
            "2",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out_json.read_text())
    assert record["ok"] is True and record["settings"]["backend"] == NAME
    assert record["settings"]["buffer_option"] is None  # nothing declared: the default
    assert record["versions"][f"wtcore-{NAME}"] == "0.2.0"
    assert set(record["baselines_gbps"]) == {"memcpy", "file"}  # the generic limits only
    (run,) = record["runs"]
    assert len(run["rounds"]) == 2
    for r in run["rounds"]:
        assert r["verified"] is True and r["mismatched_tensors"] == [0, 0]
