"""``wtcore bench`` end to end with in-process receivers: schema, verification, clean-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

WTCORE = str(Path(sys.executable).with_name("wtcore"))


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("wtcore-bench-")}


def _bench(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            WTCORE,
            "bench",
            "--size",
            "1MiB",
            "--tensors",
            "30",
            "--rounds",
            "2",
            "--json",
            str(out_json),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    record = json.loads(out_json.read_text()) if out_json.exists() else {}
    return proc, record


@pytest.mark.timeout(300)
def test_small_bench_schema_and_verification(tmp_path: Path) -> None:
    before = _shm_entries()
    proc, record = _bench("--baselines", "all", "--buffer-size", "64KiB,256KiB", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert record["ok"] is True
    assert set(record) >= {
        "host",
        "versions",
        "settings",
        "baselines_gbps",
        "runs",
        "ratios",
        "best_median_gbps",
    }
    assert record["versions"]["wtcore"] and record["versions"]["torch"].startswith("2.13")
    assert record["settings"]["backend"] == "inline" and record["settings"]["receivers"] == 2
    assert set(record["baselines_gbps"]) == {
        "memcpy",
        "file",
        "raw_gloo",
        "per_tensor",
        "shm_copy",
        "bare_read",
        "vllm_packing",
        "zmq",
        "ray_object_store",
    }
    assert set(record["peers"]) == {"vllm_packing", "ray_object_store", "zmq"}
    assert record["skipped_baselines"] == {}
    assert all(v > 0 for v in record["baselines_gbps"].values())
    # the deprecated names (until 0.3) repeat the new ones in the JSON a script reads
    assert record["limits_gbps"] == record["baselines_gbps"]
    assert record["limit_labels"] == record["baseline_labels"]
    assert [r["buffer_size"] for r in record["runs"]] == [64 << 10, 256 << 10]
    for run in record["runs"]:
        assert len(run["rounds"]) == 2
        for i, r in enumerate(run["rounds"]):
            assert r["verified"] is True and r["mismatched_tensors"] == [0, 0]
            assert r["receiver_versions"] == [f"bench-{i}"] * 2
            assert r["num_tensors"] == record["settings"]["model_tensors"]
            assert set(r["phases"]) == {"materialize", "pack", "wire", "load", "control"}
            assert r["gbps"] > 0 and r["num_buckets"] >= 1
    assert run["rounds"][0]["num_buckets"] < record["runs"][0]["rounds"][0]["num_buckets"]
    assert "OK: every receiver verified bit-exact" in proc.stdout
    assert "raw gloo broadcast" in proc.stdout
    peers = proc.stdout.split("peers: what you would use instead", 1)[1]
    assert "vLLM-style packing" in peers and "Ray object store" in peers
    assert _shm_entries() == before  # no segment left behind


@pytest.mark.timeout(300)
def test_corrupted_receiver_fails_the_run(tmp_path: Path) -> None:
    proc, record = _bench("--baselines", "none", "--corrupt-round", "1", tmp_path=tmp_path)
    assert proc.returncode == 1
    assert record["ok"] is False
    rounds = record["runs"][0]["rounds"]
    assert rounds[0]["verified"] is True
    assert rounds[1]["verified"] is False and rounds[1]["mismatched_tensors"] == [1, 0]
    assert "FAILED: a receiver does not match the trainer" in proc.stdout


@pytest.mark.timeout(300)
def test_staged_and_classic_rounds_in_turns_report_paused_time(tmp_path: Path) -> None:
    proc, record = _bench("--baselines", "none", "--staged", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    staged, classic = record["runs"]
    assert (staged["round_kind"], classic["round_kind"]) == ("staged", "classic")
    assert record["ok"] and staged["verified"] and classic["verified"]
    for run in record["runs"]:
        for r in run["rounds"]:
            assert len(r["paused_s"]) == len(r["receiver_times"]) == 2
            assert r["paused_ratio"] == [p / r["seconds"] for p in r["paused_s"]]
    for r in staged["rounds"]:  # paused for the commit only, staged the rest of the round
        assert [t["paused_s"] for t in r["receiver_times"]] == [
            t["commit_s"] for t in r["receiver_times"]
        ]
        assert all(t["staged_s"] > 0 for t in r["receiver_times"])
    for r in classic["rounds"]:  # paused from the first byte written to the finish
        assert all(t["staged_s"] is None for t in r["receiver_times"])
        assert all(t["paused_s"] >= t["commit_s"] for t in r["receiver_times"])
    assert "staged rounds" in proc.stdout and "classic rounds" in proc.stdout


def test_unknown_client_is_a_clear_error(tmp_path: Path) -> None:
    proc, _ = _bench("--client", "htp", "--baselines", "none", tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "unknown client 'htp'" in proc.stderr


@pytest.mark.timeout(300)
def test_the_old_engine_name_still_benches_and_says_the_new_one(tmp_path: Path) -> None:
    """``--backend local`` (renamed ``inline`` in 0.2.0) runs the inline engine until 0.3: one
    warning on stderr, and the record names the engine by its new name."""
    proc, record = _bench("--backend", "local", "--baselines", "none", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert record["ok"] is True and record["settings"]["backend"] == "inline"
    assert proc.stderr.count("engine 'local' was renamed 'inline'") == 1, proc.stderr


def test_the_old_engine_name_finds_the_inline_bench_support() -> None:
    from wtcore_bench.support import engine_bench

    with pytest.warns(DeprecationWarning, match="engine 'local' was renamed 'inline'"):
        assert engine_bench("local") is engine_bench("inline")
