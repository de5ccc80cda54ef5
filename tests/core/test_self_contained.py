"""The repository stands on its own: no file points at documents that live outside it.

Design notes from before the repository existed were kept beside it, not in it; whoever picks
the project up next has only the repository, so code comments and docs point at ``docs/``.
Measured numbers live in ``docs/benchmarks.md`` only, not in docstrings, where they would go
stale unseen.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
#: The first wave's notes, kept outside the repository: their names are spelled in pieces here
#: so that this file does not itself read as a citation.
_NOTES = ("DES" + "IGN", "PERF" + "_NOTES")
OUTSIDE = re.compile(rf"{_NOTES[0]}\s*§|{_NOTES[0]}\.md|{_NOTES[1]}|\.\./shared/")
#: A throughput figure (``12.5 GB/s``) in a source file's comments or docstrings.
NUMBER = re.compile(r"\b\d+(\.\d+)?\s*GB/s")


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_nothing_cites_documents_outside_the_repository() -> None:
    offenders = []
    for path in _tracked():
        if not path.is_file() or path.suffix in {".png", ".whl"}:
            continue
        text = path.read_text(errors="replace")
        offenders += [
            f"{path.relative_to(ROOT)}:{n}"
            for n, line in enumerate(text.splitlines(), 1)
            if OUTSIDE.search(line)
        ]
    assert offenders == [], offenders


def test_measured_throughput_lives_in_the_benchmarks_doc_only() -> None:
    offenders = []
    for path in _tracked():
        if path.suffix != ".py" or not path.is_file():
            continue
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"tests", "benchmarks", "examples"}:
            continue  # tests and benchmark scripts print figures; they do not state them
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if NUMBER.search(line) and 'f"' not in line and "f'" not in line:
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], offenders
