"""The README's quick-start example runs as pasted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quick_start_runs() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1]
    code = re.findall(r"```python\n(.*?)```", quick, flags=re.S)[0]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["step 0", "step 1", "step 2"]
    assert lines[-1] == "step-2"


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


def test_readme_describes_the_demo_the_makefile_runs() -> None:
    makefile = (README.parent / "Makefile").read_text()
    demo = makefile.split("\ndemo:", 1)[1].splitlines()[1].strip()
    assert demo.startswith("$(BIN)/wtcore bench ")
    args = demo.removeprefix("$(BIN)/")
    flat = " ".join(README.read_text().split())
    assert f"`{args}`" in flat, args
