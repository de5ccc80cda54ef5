"""scripts/gpu-check.sh, as ``make test`` can run it: the dry run lists every step and exits 0.

On a machine with CUDA the same script runs the steps for real; here the dry run is what
keeps it ready: every step present, every gpu-marked test file in some step, the whole
budget under 8 minutes, nothing written.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
STEPS = (
    "env",
    "gpu-tests",
    "cuda-ipc",
    "nccl-procs",
    "bench-nccl",
    "bench-ipc",
    "bench-tcp",
    "bench-mooncake",
    "bench-staged",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    tmp_path = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, tmp_path


def test_dry_run_lists_every_step_within_eight_minutes(dry_run: tuple[str, Path]) -> None:
    out, tmp_path = dry_run
    assert re.search(r"torch \S+, CUDA available: (True|False), \d+ GPU\(s\)", out), out
    rows = {m.group(1): (int(m.group(2)), m.group(3)) for m in re.finditer(
        r"^  (\S+)\s+(\d+)s  (.*)$", out, re.MULTILINE
    )}  # fmt: skip
    assert tuple(rows) == STEPS, out
    total = sum(secs for secs, _ in rows.values())
    assert total < 8 * 60 and f"{total}s at most in all" in out
    assert "--device cuda" in rows["bench-nccl"][1] and "--backend nccl" in rows["bench-nccl"][1]
    assert "--backend ipc" in rows["bench-ipc"][1] and "--json" in rows["bench-ipc"][1]
    assert "--staged" in rows["bench-staged"][1] and "--receivers 2" in rows["bench-staged"][1]
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_every_gpu_marked_test_file_is_in_some_step(dry_run: tuple[str, Path]) -> None:
    out, _ = dry_run
    marker = re.compile(r"pytest\.mark\.gpu([^\"A-Za-z_]|$)", re.MULTILINE)
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if marker.search(p.read_text())
    }
    assert {"tests/ipc/test_cuda.py", "tests/integration/test_gpu_processes.py"} <= marked
    assert "tests/core/test_gpu_check.py" not in marked  # names the marker, does not use it
    missing = [f for f in sorted(marked) if f not in out]
    assert not missing, f"gpu-marked tests the GPU check would not run: {missing}"


def test_a_dry_run_with_wheels_says_it_would_install_them_first(tmp_path: Path) -> None:
    """``--wheels DIR``: on a GPU machine whose Python has torch but not wtcore, the engines'
    entry points come from the wheels (without them only ``inline`` is registered)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("wtcore-0.2.0-py3-none-any.whl", "wtcore_ipc-0.2.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")  # a dry run installs nothing
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--wheels", str(wheels), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"first: install the 2 wheel(s) in {wheels} into a temporary folder" in proc.stdout
    assert not (tmp_path / "o").exists()


def test_wheels_from_a_folder_without_any_is_refused_at_once(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--wheels", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert f"--wheels {tmp_path}: no .whl files there" in proc.stderr


def test_the_wheel_maker_says_what_it_makes() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-wheels.sh"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--python-version X.Y" in proc.stdout, proc.stderr
    missing = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-wheels.sh")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "name the folder for the wheels" in missing.stderr
