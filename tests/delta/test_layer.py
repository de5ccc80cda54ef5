"""Delta rounds are a layer on the core: the core never reaches into them.

``wtcore_delta`` (the wtcore-delta distribution) imports the trainer (its round policy
subclasses ``RoundPolicy``; its receiver sink is a ``wtcore.worker.ReceiverLayer``, a protocol,
found by name), never the reverse: the base trainer, the worker and the kit must not import
``wtcore_delta`` (nor its old path ``wtcore.delta``) anywhere (at module level, under
``TYPE_CHECKING`` or inside a function) nor keep delta state. Read with ``ast``, so a lazy import cannot hide from it. Without wtcore-delta
(simulated by turning plugin discovery off) ``delta=True`` names its install line and a worker
reports ``delta: false``, so a trainer that has it sends that worker full rounds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The user-facing init-info fields (``TrainerInitInfo``) that select and tune the layer.
USER_FIELDS = {"delta", "delta_base_device"}


def _tree(name: str) -> ast.Module:
    return ast.parse((ROOT / name).read_text(), filename=name)


DELTA = ("wtcore_delta", "wtcore.delta")


@pytest.mark.parametrize(
    "name", ["wtcore/trainer.py", "wtcore/worker.py", "wtcore_kit/bucketed.py"]
)
def test_no_import_of_wtcore_delta(name: str) -> None:
    found = []
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(DELTA)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(DELTA):
            found.append(node.module or "")
    assert found == [], f"{name} imports {found}"


@pytest.mark.parametrize(
    "name", ["wtcore/trainer.py", "wtcore/worker.py", "wtcore_kit/bucketed.py"]
)
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
    from wtcore.trainer import RoundPolicy
    from wtcore_delta.trainer import DeltaRounds
    from wtcore_kit.inline import InlineTrainerEngine, InlineTrainerInitInfo

    with InlineTrainerEngine(
        InlineTrainerInitInfo(rank=1, delta=True), client=None, source=None
    ) as e:
        assert type(e.rounds) is DeltaRounds
    with InlineTrainerEngine(InlineTrainerInitInfo(rank=1), client=None, source=None) as e:
        assert type(e.rounds) is RoundPolicy


def test_the_worker_puts_the_delta_layer_first() -> None:
    from wtcore.sink import ModuleSink
    from wtcore.testing.sources import build_module, synthetic_state
    from wtcore.worker import WeightSyncWorker
    from wtcore_delta.receiver import DeltaSink

    worker = WeightSyncWorker("inline", ModuleSink(build_module(synthetic_state(1 << 12, 2))))
    assert isinstance(worker.engine.sink.inner, DeltaSink)  # behind the byte ledger only
    assert worker.weight_info()["delta"] is True


def _rediscover() -> None:
    from wtcore.registry import RECEIVER_LAYERS, ROUND_POLICIES

    for registry in (ROUND_POLICIES, RECEIVER_LAYERS):
        registry.refresh()


@pytest.fixture
def without_wtcore_delta(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As if wtcore-delta were not installed: no entry point is discovered (none is imported)."""
    monkeypatch.setenv("WTCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    _rediscover()
    yield
    monkeypatch.delenv("WTCORE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    _rediscover()


@pytest.mark.usefixtures("without_wtcore_delta")
def test_without_wtcore_delta_delta_true_names_the_install_line() -> None:
    from wtcore.errors import PluginLoadError
    from wtcore.trainer import RoundPolicy
    from wtcore_kit.inline import InlineTrainerEngine, InlineTrainerInitInfo

    info = InlineTrainerInitInfo(rank=1, delta=True)
    with pytest.raises(PluginLoadError, match=r"'delta'.*pip install wtcore-delta") as exc:
        InlineTrainerEngine(info, client=None, source=None)
    assert exc.value.reason == "not-found"
    with InlineTrainerEngine(InlineTrainerInitInfo(rank=1), client=None, source=None) as e:
        assert type(e.rounds) is RoundPolicy


def test_a_worker_without_wtcore_delta_gets_full_rounds(
    monkeypatch: pytest.MonkeyPatch, without_wtcore_delta: None
) -> None:
    import torch

    from wtcore.factory import WeightTransferTrainerFactory
    from wtcore.sink import ModuleSink
    from wtcore.source import TensorSource
    from wtcore.testing.delta import assert_bits_equal
    from wtcore.testing.sources import build_module, zeros_like_state
    from wtcore.worker import WeightSyncWorker
    from wtcore_kit.inline import InlineTrainerInitInfo
    from wtcore_kit.inproc import InProcessClient

    state = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    sink = ModuleSink(build_module(zeros_like_state(state)))
    worker = WeightSyncWorker("inline", sink)  # built without the delta layer
    assert worker.engine.sink.inner is sink  # nothing but the byte ledger in front
    assert worker.weight_info()["delta"] is False
    monkeypatch.delenv("WTCORE_DISABLE_PLUGIN_AUTOLOAD")  # the trainer has wtcore-delta
    _rediscover()
    info = InlineTrainerInitInfo(rank=0, delta=True)
    client = InProcessClient([worker], timeout_s=30)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    ) as trainer:
        reports = []
        for step in range(3):
            state["w"][0, step] += 1
            stats = trainer.send_weights(weight_version=f"v{step}")
            assert stats.delta is not None
            reports.append(stats.delta)
    assert [r["mode"] for r in reports] == ["full"] * 3
    assert reports[-1]["why"] == "receiver 0 does not take patches"
    assert_bits_equal(dict(sink.named_tensors()), state)
    assert worker.weight_info()["weight_version"] == "v2"


def test_the_bench_without_wtcore_delta_names_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from wtcore_bench.api import OptionalDependencyError
    from wtcore_bench.delta import DeltaBenchOptions, run_delta_bench

    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "wtcore_delta" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(OptionalDependencyError, match="pip install wtcore-delta"):
        run_delta_bench(DeltaBenchOptions(steps=1, dense_rounds=1, width=8))
