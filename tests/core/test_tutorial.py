"""Runs every code block of docs/writing-an-engine.md, then its contract suite.

The python blocks are executed in order, as one module, so the page cannot drift from the
code. The last block defines a contract-suite subclass, which is collected from here.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-an-engine.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def _load_tutorial() -> types.ModuleType:
    module = types.ModuleType("wtcore_tutorial_engine")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile("\n".join(BLOCKS), str(DOC), "exec"), module.__dict__)
    return module


tutorial = _load_tutorial()
TestTmpfileContract = tutorial.TestTmpfileContract


def test_doc_has_the_expected_blocks() -> None:
    assert len(BLOCKS) >= 5
    assert "class TestTmpfileContract" in BLOCKS[-1]


def test_toml_block_matches_the_class_names() -> None:
    toml = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    assert 'tmpfile = "my_engine:ENGINE"' in toml
    assert tutorial.ENGINE.trainer == "my_engine:TmpfileTrainerEngine"
    assert tutorial.ENGINE.worker == "my_engine:TmpfileWorkerEngine"
    assert hasattr(tutorial, "TmpfileWorkerEngine") and hasattr(tutorial, "TmpfileTrainerEngine")


def test_bad_file_name_is_rejected_before_reading() -> None:
    from wtcore import PayloadError

    engine = tutorial.TmpfileWorkerEngine(
        __import__("wtcore").WeightTransferConfig("tmpfile"), sink=None
    )
    with pytest.raises(PayloadError, match="file_name: expected a bare wtcore-tmpfile-"):
        engine.parse_update_info(
            {"file_name": "../etc/passwd", "names": [], "dtype_names": [], "shapes": []}
        )
