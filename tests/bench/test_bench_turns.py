"""``wtcore bench --interleave``: limits measured in turns with the engine's rounds."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from wtcore.errors import TransferError
from wtcore_bench import Baseline, BaselineContext, OptionalDependencyError
from wtcore_bench.api import BaselineSession
from wtcore_bench.limits import GENERIC_BASELINES, session_gbps
from wtcore_bench.turns import Turns

WTCORE = str(Path(sys.executable).with_name("wtcore"))


def _ctx() -> BaselineContext:
    return BaselineContext(state={}, nbytes=1 << 20, receivers=1)


def _recording(events: list[str], name: str) -> BaselineSession:
    @contextlib.contextmanager
    def session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
        events.append(f"open {name}")
        try:
            yield lambda: events.append(f"call {name}")
        finally:
            events.append(f"close {name}")

    return session


def _missing(ctx: BaselineContext) -> contextlib.AbstractContextManager[Callable[[], object]]:
    raise OptionalDependencyError("pip install something-absent")


def test_each_turn_calls_every_session_once_and_closes_them_all_after_a_failure() -> None:
    events: list[str] = []
    skipped: dict[str, str] = {}
    baselines = {
        "a": Baseline("a", lambda ctx: 1.0, session=_recording(events, "a")),
        "gone": Baseline("gone", lambda ctx: 1.0, session=_missing),
        "b": Baseline("b", lambda ctx: 1.0, session=_recording(events, "b")),
    }
    with (
        pytest.raises(TransferError, match="a round failed"),
        Turns.open(baselines, _ctx(), skipped) as turns,
    ):
        assert events == ["open a", "call a", "open b", "call b"]  # one warm-up call each
        events.clear()
        first = turns.run_each()
        turns.run_each()
        assert events == ["call a", "call b"] * 2
        assert set(first) == {"a", "b"} and all(s >= 0 for s in first.values())
        events.clear()
        raise TransferError("a round failed")
    assert events == ["close b", "close a"]  # released, in reverse order, despite the error
    assert skipped == {"gone": "pip install something-absent"}
    assert [len(v) for v in turns.seconds.values()] == [2, 2]
    assert turns.gbps(1 << 20) == {
        n: (1 << 20) / statistics.median(v) / 1e9 for n, v in turns.seconds.items()
    }


def test_a_session_that_fails_to_open_releases_the_ones_opened_before() -> None:
    events: list[str] = []

    def broken(ctx: BaselineContext) -> contextlib.AbstractContextManager[Callable[[], object]]:
        raise TransferError("cannot start the baseline's receivers")

    baselines = {
        "a": Baseline("a", lambda ctx: 1.0, session=_recording(events, "a")),
        "b": Baseline("b", lambda ctx: 1.0, session=broken),
    }
    with pytest.raises(TransferError, match="cannot start"), Turns.open(baselines, _ctx(), {}):
        pass
    assert events == ["open a", "call a", "close a"]


def test_memcpy_session_copies_and_its_measure_derives_from_it() -> None:
    memcpy = GENERIC_BASELINES["memcpy"]
    assert memcpy.session is not None
    assert session_gbps(memcpy.session, _ctx(), repeats=2) > 0
    assert memcpy.measure(_ctx()) > 0


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "bench.json"
    small = ["--size", "1MiB", "--tensors", "20", "--rounds", "3", "--receivers", "1"]
    proc = subprocess.run(
        [WTCORE, "bench", *small, "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_interleaved_baselines_are_the_median_of_their_turns_before_each_round(
    tmp_path: Path,
) -> None:
    proc, record = _bench(tmp_path, "--interleave")
    assert record["ok"] is True and record["settings"]["interleave"] is True
    assert record["interleaved"] == ["memcpy"]  # the generic limit with a session
    rounds = record["runs"][0]["rounds"]
    assert [set(r["baseline_seconds"]) for r in rounds] == [{"memcpy"}] * 3
    seconds = [r["baseline_seconds"]["memcpy"] for r in rounds]
    nbytes = record["settings"]["model_bytes"]
    assert record["baselines_gbps"]["memcpy"] == pytest.approx(
        nbytes / statistics.median(seconds) / 1e9
    )
    assert set(record["baselines_gbps"]) == {"memcpy", "file"}
    table = proc.stdout.split("measured in this run", 1)[1]
    assert table.index("single-thread memcpy *") < table.index("torch.save")  # declared order
    assert "* measured in turns with the engine's rounds" in proc.stdout


@pytest.mark.timeout(300)
def test_without_interleave_every_baseline_is_measured_before_the_rounds(tmp_path: Path) -> None:
    proc, record = _bench(tmp_path)
    assert record["interleaved"] == []
    assert all(r["baseline_seconds"] == {} for r in record["runs"][0]["rounds"])
    assert set(record["baselines_gbps"]) == {"memcpy", "file"}
    assert "*" not in proc.stdout.split("measured in this run", 1)[1]
