"""Delta rounds are a layer on the send template: the template never reaches into them.

``wtcore.delta`` imports the trainer (its round policy subclasses ``RoundPolicy``), never the
reverse: the base trainer and the kit must not import ``wtcore.delta`` anywhere (at module
level, under ``TYPE_CHECKING`` or inside a function) nor keep delta state. Read with ``ast``,
so a lazy import cannot hide from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "wtcore"
#: The user-facing init-info fields (``TrainerInitInfo``) that select and tune the layer.
USER_FIELDS = {"delta", "delta_base_device"}


def _tree(name: str) -> ast.Module:
    return ast.parse((ROOT / name).read_text(), filename=name)


@pytest.mark.parametrize("name", ["trainer.py", "kit.py"])
def test_no_import_of_wtcore_delta(name: str) -> None:
    found = []
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("wtcore.delta")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wtcore.delta"):
            found.append(node.module or "")
    assert found == [], f"{name} imports {found}"


@pytest.mark.parametrize("name", ["trainer.py", "kit.py"])
def test_no_delta_attributes_but_the_user_fields(name: str) -> None:
    names = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    delta = {n for n in names if n.lstrip("_").lower().startswith("delta")}
    assert delta <= USER_FIELDS, f"{name} names {sorted(delta - USER_FIELDS)}"


def test_delta_true_selects_the_delta_policy() -> None:
    from wtcore.delta.trainer import DeltaRounds
    from wtcore.inline import InlineTrainerEngine, InlineTrainerInitInfo
    from wtcore.trainer import RoundPolicy

    with InlineTrainerEngine(
        InlineTrainerInitInfo(rank=1, delta=True), client=None, source=None
    ) as e:
        assert type(e.rounds) is DeltaRounds
    with InlineTrainerEngine(InlineTrainerInitInfo(rank=1), client=None, source=None) as e:
        assert type(e.rounds) is RoundPolicy
