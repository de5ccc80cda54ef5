"""The distributions as a user gets them: built from a clean tree, checked as an index would
check them, installed (not editable) into a fresh venv outside the source tree, and used."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from email.parser import Parser

import pytest
from packaging.requirements import Requirement

from .conftest import Release
from .dists import DISTRIBUTIONS, REPO, URL, compatible_pin, core_version, relative_links

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.timeout(900)]


def test_twine_check_passes(release: Release) -> None:
    files = sorted(str(p) for p in release.dist.iterdir())
    assert len(files) == 2 * len(DISTRIBUTIONS), files
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_wheel_metadata(release: Release, dist: str) -> None:
    text = release.metadata(dist)
    meta = Parser().parsestr(text)
    assert meta["Name"] == dist and meta["Version"] == core_version()
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["Author"] == "wtcore developers" and meta["Keywords"]
    assert meta["Summary"] and not meta["Summary"].startswith("wtcore plugin: ")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Changelog", "Issues"}
    assert all(u.startswith(URL) for u in urls.values())
    assert "Programming Language :: Python :: 3 :: Only" in meta.get_all("Classifier")
    assert meta["Description-Content-Type"] == "text/markdown"
    assert relative_links(meta.get_payload()) == []
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    names = {r.name for r in requires}
    assert "importlib-metadata" not in names
    if dist != "wtcore":
        (pin,) = [str(r) for r in requires if r.name == "wtcore"]
        assert pin == compatible_pin(core_version())
    with zipfile.ZipFile(release.wheel(dist)) as z:
        (lic,) = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert z.read(lic) == (REPO / "LICENSE").read_bytes()
    with tarfile.open(release.sdist(dist)) as t:
        (member,) = [m for m in t.getmembers() if re.fullmatch(r"[^/]+/LICENSE", m.name)]
        assert member.isfile(), "the sdist must carry the license itself, not a link"


def test_core_alone_names_the_distribution_of_every_missing_plugin(release: Release) -> None:
    """Only torch and the core wheel are installed: each plugin-provided name fails with a
    WtcoreError (and LookupError) that says which distribution to install."""
    script = """
import importlib.util, json, sys
import wtcore
from wtcore import WtcoreError, trainer_from_config
from wtcore.registry import ENGINES

out = {"torch_imported": "torch" in sys.modules,
       "backport": importlib.util.find_spec("importlib_metadata") is not None,
       "errors": {}}
configs = {
    "nccl": {"backend": "nccl"},
    "tcp": {"backend": "tcp"},
    "ipc": {"backend": "ipc"},
    "http": {"backend": "inline", "client": {"name": "http", "urls": ["http://127.0.0.1:9"]}},
    "ray": {"backend": "inline", "client": {"name": "ray"}},
}
for name, config in configs.items():
    try:
        trainer_from_config(config)
    except WtcoreError as e:
        out["errors"][name] = [type(e).__name__, isinstance(e, LookupError), str(e)]
for name in ("nccl", "tcp", "ipc"):  # the inference side looks engines up in its own registry
    try:
        ENGINES.load(name)
    except WtcoreError as e:
        out["errors"]["worker " + name] = [type(e).__name__, isinstance(e, LookupError), str(e)]
out["inline"] = ENGINES.load("inline").__module__  # the built-in, from the core wheel's kit
print(json.dumps(out))
"""
    proc = release.run("-c", script)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["torch_imported"] is False, "import wtcore must not import torch"
    assert out["backport"] is False, "the core must not pull importlib-metadata"
    assert out["inline"] == "wtcore_kit.inline", "the core wheel carries the kit and its built-in"
    want = {
        "nccl": "wtcore-nccl",
        "tcp": "wtcore-tcp",
        "ipc": "wtcore-ipc",
        "http": "wtcore-http-client",
        "ray": "wtcore-ray-client",
        "worker nccl": "wtcore-nccl",
        "worker tcp": "wtcore-tcp",
        "worker ipc": "wtcore-ipc",
    }
    assert set(out["errors"]) == set(want)
    for name, dist in want.items():
        cls, is_lookup, msg = out["errors"][name]
        assert is_lookup, (name, cls, msg)
        assert f"pip install {dist}" in msg, (name, msg)
    # and the commands other distributions add say where they come from
    for command, dist in (("bench", "wtcore-bench"), ("serve", "wtcore-http-client")):
        proc = release.run("-m", "wtcore", command, "--size", "1MiB")
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert f"'{command}' is provided by {dist}: pip install {dist}" in proc.stderr


@pytest.fixture
def with_nccl(release: Release) -> Iterator[Release]:
    """wtcore-nccl (with wtcore-channel, its kit) and wtcore-bench installed from their wheels
    for one test, then removed again, so the shared venv is "core only" for every other test
    whatever the order."""
    dists = ("wtcore-channel", "wtcore-nccl", "wtcore-bench")
    wheels = [str(release.wheel(d)) for d in dists]
    release.pip("install", "--quiet", "--no-compile", *wheels)
    try:
        yield release
    finally:
        release.pip("uninstall", "--quiet", "--yes", *dists)


def test_installed_wheels_run_a_verified_nccl_sync(
    with_nccl: Release, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``wtcore bench`` from the installed wheels: a trainer broadcasting over gloo to two
    receiver processes, every receiver checked bit-exact."""
    out_json = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = with_nccl.run(
        "-m",
        "wtcore",
        "bench",
        "--backend",
        "nccl",
        "--client",
        "inproc",
        "--size",
        "1MiB",
        "--tensors",
        "10",
        "--rounds",
        "1",
        "--baselines",
        "none",
        "--timeout",
        "120",
        "--json",
        str(out_json),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out_json.read_text())
    assert record["ok"] is True
    assert record["versions"]["wtcore-nccl"] == core_version()
    (run,) = record["runs"]
    assert [r["verified"] for r in run["rounds"]] == [True]
    # and it ran from the installed wheels, not from the source tree
    where = with_nccl.run(
        "-c",
        "import wtcore, wtcore_nccl, wtcore_bench; "
        "print(wtcore.__file__, wtcore_nccl.__file__, wtcore_bench.__file__)",
    )
    assert where.returncode == 0, where.stderr
    assert str(REPO) not in where.stdout and "site-packages" in where.stdout
