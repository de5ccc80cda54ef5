"""``wtcore plugins`` against real distributions: conflicts, broken plugins, columns, JSON, pipes.

Each test writes tiny ``*.dist-info`` folders (METADATA + entry_points.txt) into a temporary
directory and runs the real console script with that directory on ``PYTHONPATH``, exactly as
if the distributions had been installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.processes

WTCORE = str(Path(sys.executable).with_name("wtcore"))


def _dist(where: Path, name: str, entry_points: str, version: str = "1.0") -> None:
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


def _run(path: Path | None, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("WTCORE_DISABLE_PLUGIN_AUTOLOAD", None)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run(
        [WTCORE, "plugins", *args],
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=env,
        **kw,
    )


def test_clean_install_exits_zero_with_valid_json() -> None:
    out = _run(None, "--json")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["schema"] == 1 and record["ok"] is True and record["discovery"] is True
    groups = [r["group"] for r in record["registries"]]
    assert groups == ["wtcore.backends", "wtcore.backends", "wtcore.clients"]
    titles = [r["title"] for r in record["registries"]]
    assert titles == ["engines", "trainer engines", "clients"]
    inline = next(p for p in record["registries"][0]["plugins"] if p["name"] == "inline")
    assert inline == {
        "name": "inline",
        "target": "wtcore_kit.inline:InlineWorkerEngine",
        "distribution": "wtcore",
        "version": inline["version"],
        "origin": f"wtcore {inline['version']}",
        "ok": True,
        "status": "available",
    }
    assert record["hooks"]["group"] == "wtcore.hooks" and record["hooks"]["errors"] == []


def test_two_distributions_one_name_is_shown_and_exits_one(tmp_path: Path) -> None:
    _dist(tmp_path, "quic-one", "[wtcore.backends]\nquic = quic_one:ENGINE\n")
    _dist(tmp_path, "quic-two", "[wtcore.backends]\nquic = quic_two:ENGINE\n", version="2.0")
    out = _run(tmp_path)
    assert out.returncode == 1
    (line, _) = [x for x in out.stdout.splitlines() if x.startswith("  quic ")]  # both halves
    assert "CONFLICT: engine 'quic' is registered in wtcore.backends by 2 distributions" in line
    assert "quic-one 1.0 (quic_one:ENGINE)" in line and "quic-two 2.0 (quic_two:ENGINE)" in line
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == "wtcore plugins: some plugins are broken or conflicting"

    record = json.loads(_run(tmp_path, "--json").stdout)
    assert record["ok"] is False
    (conflict,) = record["registries"][0]["conflicts"]
    assert conflict["name"] == "quic" and conflict["builtin"] is False
    assert {p["distribution"] for p in conflict["providers"]} == {"quic-one", "quic-two"}
    assert conflict["message"] in line


def test_a_plugin_shadowing_a_builtin_is_a_conflict(tmp_path: Path) -> None:
    _dist(tmp_path, "shadow", "[wtcore.clients]\ninproc = shadow_mod:Client\n")
    out = _run(tmp_path)
    assert out.returncode == 1
    assert re.search(
        r"^  inproc +CONFLICT: client 'inproc' is built into wtcore .*shadow 1\.0 "
        r"\(shadow_mod:Client\) also registers it .*may not shadow a built-in name",
        out.stdout,
        re.M,
    )


def test_a_broken_plugin_exits_one_without_a_traceback(tmp_path: Path) -> None:
    _dist(tmp_path, "brokenplug", "[wtcore.backends]\nbroken = no_such_module_xyz:ENGINE\n")
    out = _run(tmp_path)
    assert out.returncode == 1
    assert re.search(
        r"^  broken +brokenplug 1\.0 +BROKEN: engine 'broken' from brokenplug 1\.0 failed to "
        r"import no_such_module_xyz:ENGINE: ModuleNotFoundError",
        out.stdout,
        re.M,
    )
    assert "Traceback" not in out.stderr


def test_columns_fit_the_longest_name_hooks_included(tmp_path: Path) -> None:
    (tmp_path / "quiet_hooks_mod.py").write_text("# a hook plugin that implements nothing\n")
    (tmp_path / "long_engine_mod.py").write_text(
        "from wtcore.registry import Halves\n"
        'ENGINE = Halves(trainer="wtcore_kit.inline:InlineTrainerEngine", '
        'worker="wtcore_kit.inline:InlineWorkerEngine")\n'
    )
    _dist(
        tmp_path,
        "longnames",
        "[wtcore.backends]\n"
        "a_rather_long_engine_name = long_engine_mod:ENGINE\n"
        "[wtcore.hooks]\n"
        "a_hook_plugin_with_an_even_longer_name = quiet_hooks_mod\n",
    )
    out = _run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [x for x in out.stdout.splitlines() if x.startswith("  ")]
    # every row: two spaces, the name padded to one width, two spaces, then the origin
    starts = {len(m.group(1)) for m in (re.match(r"(  \S+ +)\S", r) for r in rows) if m}
    assert len(starts) == 1, out.stdout
    assert "  a_hook_plugin_with_an_even_longer_name  longnames 1.0" in out.stdout
    # the origin column is aligned too: "available" starts at one column in every row
    status_cols = {r.index("  available") for r in rows if r.endswith("  available")}
    assert len(status_cols) == 1 and len(rows) > 3, out.stdout


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `wtcore plugins | head -0`: nobody reads
    try:
        out = _run(None, stdout=write_end)
    finally:
        os.close(write_end)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == 0
