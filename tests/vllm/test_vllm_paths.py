"""The adapter finds vLLM's weight-transfer package at its old and its new path.

Run in vLLM's venv: against the installed vLLM (the old path, ``vllm.distributed``), then with
the package moved to ``vllm.backends.distributed.weight_transfer`` (a stub package at the new
path holding the installed modules, and nothing left at the old one), as newer vLLM releases do.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm.vllm_kit import VLLM_PYTHON

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.timeout(300)]

MOVED = """
import importlib, json, sys, types
old = "vllm.distributed.weight_transfer"
base, factory = (importlib.import_module(f"{old}.{m}") for m in ("base", "factory"))
for name in [n for n in sys.modules if n == old or n.startswith(old + ".")]:
    sys.modules[name] = None  # importing anything at the old path now fails
new = "vllm.backends.distributed.weight_transfer"
for i, part in enumerate(new.split(".")[1:], start=2):
    pkg = types.ModuleType(".".join(new.split(".")[:i]))
    pkg.__path__ = []
    sys.modules[pkg.__name__] = pkg
sys.modules[new + ".base"], sys.modules[new + ".factory"] = base, factory
from wtcore_vllm.engine import VLLMEngine
from wtcore_vllm.plugin import register
added = register()
print(json.dumps([VLLMEngine is base.WeightTransferEngine, "wtcore_nccl" in added]))
"""

MISSING = """
import sys
for name in ("vllm.distributed.weight_transfer.base", "vllm.backends"):
    sys.modules[name] = None
try:
    import wtcore_vllm.engine
except ImportError as e:
    print(e)
"""


def _run(code: str) -> str:
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=240, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_the_installed_path_and_the_moved_one() -> None:
    assert json.loads(_run(MOVED)) == [True, True]
    from_installed = _run(
        "from wtcore_vllm.engine import VLLMEngine\n"
        "from vllm.distributed.weight_transfer.base import WeightTransferEngine as E\n"
        "print(VLLMEngine is E)"
    )
    assert from_installed == "True"


def test_a_vllm_without_the_package_names_both_paths() -> None:
    message = _run(MISSING)
    assert "no weight-transfer module 'base'" in message
    assert "vllm.backends.distributed.weight_transfer.base" in message
    assert "vllm.distributed.weight_transfer.base" in message
