"""No pickle anywhere in the distributed code: an ``ast`` scan of every module we ship.

Scanned: every ``.py`` under ``wtcore/`` and ``plugins/*/`` (the core and all plugins, their
CLIs, benches and testing kits). Ray pickles internally to move its own objects; that is
Ray's code, not ours, and our Ray control plane only hands it JSON-checked values
(``wtcore_ray_client._json``).

Refused:
* importing ``pickle``, ``cPickle``, ``_pickle``, ``dill``, ``cloudpickle``, ``marshal``,
  ``shelve`` or ``joblib`` (plain or ``from`` imports, at any depth);
* a call ``<pickle-like>.loads/load/Unpickler(...)``, by module name or through an alias;
* ``torch.load`` without ``weights_only=True`` (its ``weights_only=False`` mode unpickles
  arbitrary code). The only call, in ``wtcore_bench/limits.py``, passes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PICKLE_LIKE = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
LOADERS = {"loads", "load", "Unpickler"}


def _sources() -> list[Path]:
    files = sorted((ROOT / "wtcore").rglob("*.py")) + sorted((ROOT / "wtcore_kit").rglob("*.py"))
    for plugin in sorted((ROOT / "plugins").iterdir()):
        if plugin.is_dir():
            files += sorted(p for p in plugin.rglob("*.py") if "egg-info" not in str(p))
    return files


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}  # local name -> pickle-like module it refers to
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in PICKLE_LIKE:
                    found.append(f"line {node.lineno}: import {a.name}")
                    aliases[a.asname or top] = top
        elif isinstance(node, ast.ImportFrom):
            top = (node.module or "").split(".")[0]
            if top in PICKLE_LIKE:
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for a in node.names:
                if a.name in PICKLE_LIKE:
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                owner, attr = f.value.id, f.attr
                if attr in LOADERS and (owner in PICKLE_LIKE or owner in aliases):
                    found.append(f"line {node.lineno}: {owner}.{attr}(...)")
                if owner == "torch" and attr == "load":
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if not (
                        weights_only
                        and isinstance(weights_only[0].value, ast.Constant)
                        and weights_only[0].value.value is True
                    ):
                        found.append(f"line {node.lineno}: torch.load without weights_only=True")
    return found


def test_the_scan_covers_the_core_and_every_plugin() -> None:
    files = _sources()
    assert len(files) > 40
    for part in ("wtcore", "nccl", "ipc", "http_client", "ray_client"):
        assert any(f"/{part}/" in str(p) for p in files), part


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle(path: Path) -> None:
    assert not _problems(path), f"{path.relative_to(ROOT)}: {_problems(path)}"


@pytest.mark.parametrize(
    "code",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from dill import loads",
        "from ray import cloudpickle",
        "import os, marshal",
        "import pickle as p\np.loads(b'')",
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
    ],
)
def test_the_scan_catches(tmp_path: Path, code: str) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(code + "\n")
    assert _problems(bad)


def test_the_scan_allows_safe_code(tmp_path: Path) -> None:
    ok = tmp_path / "ok.py"
    ok.write_text("import json\njson.loads('1')\ntorch.load(f, weights_only=True)\n")
    assert _problems(ok) == []
