"""``import wtcore`` and listing every registry import no heavy package and no plugin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.core.test_old_paths import OLD_PATHS

pytestmark = pytest.mark.processes

SCRIPT = """
import json, sys
hooks = len(sys.meta_path)
import wtcore
hooks = len(sys.meta_path) - hooks
from wtcore import CLIENTS, ENGINES, TRAINER_ENGINES
names = {"engines": ENGINES.names(), "trainer": TRAINER_ENGINES.names(), "clients": CLIENTS.names()}
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in {"torch", "ray", "requests", "numpy"} or m.startswith("wtcore_"))
print(json.dumps({"heavy": heavy, "names": names, "hooks": hooks}))
"""


def test_import_and_listing_import_nothing_heavy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["heavy"] == []
    assert result["hooks"] == 0  # import wtcore adds no import hook
    assert "inline" in result["names"]["engines"] and "inproc" in result["names"]["clients"]


TOOLING = """
import json, sys
import wtcore_nccl.trainer, wtcore_nccl.worker, wtcore_ipc.trainer, wtcore_ipc.worker
from wtcore import CLIENTS, ENGINES, TRAINER_ENGINES
for registry in (ENGINES, TRAINER_ENGINES, CLIENTS):
    for name in registry.names():
        registry.load(name)
print(json.dumps(sorted(m for m in sys.modules
                        if m.startswith(("wtcore_bench", "wtcore.testing")) or m in OLD_PATHS)))
"""


def test_loading_every_engine_and_client_loads_no_tooling() -> None:
    """The protocol knows no tooling: engines and clients never load the bench or the tests'
    helpers (the bench finds them, not the other way round), nor a module's old path."""
    script = f"OLD_PATHS = {sorted(OLD_PATHS)!r}\n{TOOLING}"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []
