"""One session-scoped release: the eight distributions built from a clean copy of the tree, and a
fresh virtual environment outside the source tree with torch and the core wheel installed (not
editable, no system site-packages). The wheel tests share it, since torch is most of the cost.

Torch installs while the wheels build; pip resolves everything the way the Makefile does (its
configured index and find-links), the wtcore wheels come from the files just built. Builds use
``--no-isolation`` (the dev venv has setuptools and build), so they need no index at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

from .dists import DISTRIBUTIONS, REPO

#: Every blocking step gets this long (a cold pip cache on a loaded 2-core machine is slow).
STEP_TIMEOUT_S = 420


@dataclass(frozen=True)
class Release:
    root: Path
    dist: Path
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def wheel(self, dist: str) -> Path:
        (found,) = self.dist.glob(f"{dist.replace('-', '_')}-*.whl")
        return found

    def sdist(self, dist: str) -> Path:
        (found,) = self.dist.glob(f"{dist.replace('-', '_')}-*.tar.gz")
        return found

    def metadata(self, dist: str) -> str:
        with zipfile.ZipFile(self.wheel(dist)) as z:
            (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            return z.read(name).decode()

    def pip(self, *args: str) -> None:
        _check([*_pip(self.python), *args], cwd=self.root, what=f"pip {' '.join(args)}")

    def run(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """Run the venv's python outside the source tree, with no trace of the dev venv."""
        return subprocess.run(
            [str(self.python), *args],
            cwd=self.root,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _pip(python: Path) -> list[str]:
    """The dev venv's pip, installing into ``python``'s environment (so the venv needs no pip)."""
    return [sys.executable, "-m", "pip", "--python", str(python)]


def _check(cmd: list[str], *, cwd: Path, what: str) -> None:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=STEP_TIMEOUT_S
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )


def _wait(proc: subprocess.Popen[str], what: str) -> None:
    try:
        out, _ = proc.communicate(timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{what}: still running after {STEP_TIMEOUT_S} s")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}):\n{out[-4000:]}")


def _copy_clean_tree(dest: Path) -> None:
    """The files git would commit (tracked plus untracked-not-ignored): no build/, no
    *.egg-info, no venvs. Symlinks stay symlinks, as a checkout has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src, dst = REPO / rel, dest / rel
        if not src.is_symlink() and not src.exists():
            continue  # deleted in the work tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


@pytest.fixture(scope="session")
def release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    root = tmp_path_factory.mktemp("release")
    src, dist, venv = root / "src", root / "dist", root / "venv"
    _copy_clean_tree(src)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    rel = Release(root, dist, venv)
    # The torch the dev venv has (a CPU build here), so pip finds it where it found it then.
    torch = subprocess.Popen(
        [*_pip(rel.python), "install", "--quiet", "--no-compile", f"torch=={version('torch')}"],
        cwd=root,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    builds = {
        name: subprocess.Popen(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src / d)],
            cwd=root,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, d in DISTRIBUTIONS.items()
    }
    try:
        for name, proc in builds.items():
            _wait(proc, f"python -m build {DISTRIBUTIONS[name]}")
        _wait(torch, "pip install torch")
    finally:
        for proc in [torch, *builds.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    rel.pip("install", "--quiet", "--no-compile", str(rel.wheel("wtcore")))
    yield rel
