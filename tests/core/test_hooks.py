"""pluggy hooks: update observers and plugin-contributed CLI commands."""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import (
    ModuleSink,
    PayloadError,
    PluginLoadError,
    TensorSource,
    TransferStats,
    WeightSyncWorker,
)
from wtcore import hooks as wt_hooks
from wtcore.cli import main
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.hookspecs import hookimpl
from wtcore.testing import MismatchedSource, build_module, mixed_dtype_state, zeros_like_state
from wtcore_kit.inline import InlineTrainerInitInfo


class Observer:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    @hookimpl
    def wtcore_update_started(self, weight_version: str | None) -> None:
        self.events.append(("started", weight_version))

    @hookimpl
    def wtcore_update_finished(self, stats: TransferStats, weight_version: str | None) -> None:
        self.events.append(("finished", (weight_version, stats)))

    @hookimpl
    def wtcore_update_failed(self, weight_version: str | None, error: BaseException) -> None:
        self.events.append(("failed", (weight_version, type(error).__name__)))


class Exploding:
    @hookimpl
    def wtcore_update_started(self) -> None:
        raise RuntimeError("metrics backend down")


@pytest.fixture
def observer() -> Iterator[Observer]:
    obs = Observer()
    name = wt_hooks.register_hooks(obs, name="test-observer")
    yield obs
    wt_hooks.unregister_hooks(name=name)


def _trainer(state: dict[str, torch.Tensor]) -> Any:
    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    return WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0), client=worker, source=TensorSource(state)
    )


def test_observers_see_started_finished_failed(observer: Observer) -> None:
    state = mixed_dtype_state()
    engine = _trainer(state)
    stats = engine.send_weights(weight_version="v1")
    assert observer.events[0] == ("started", "v1")
    assert observer.events[1] == ("finished", ("v1", stats)) and stats.num_tensors == len(state)
    with pytest.raises(PayloadError, match="metadata"):
        engine.send_weights(MismatchedSource(TensorSource(state), "extra"), weight_version="v2")
    assert observer.events[-1] == ("failed", ("v2", "PayloadError"))


def test_non_sender_ranks_fire_no_hooks(observer: Observer) -> None:
    state = mixed_dtype_state()
    engine = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=1), client=None, source=TensorSource(state)
    )
    stats = engine.send_weights(weight_version="v1")
    assert stats.num_tensors == len(state) and stats.num_buckets == 0
    assert observer.events == []


def test_a_raising_observer_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    name = wt_hooks.register_hooks(Exploding(), name="exploding")
    try:
        with caplog.at_level(logging.ERROR, logger="wtcore.hooks"):
            _trainer(mixed_dtype_state()).send_weights(weight_version="v")
    finally:
        wt_hooks.unregister_hooks(name=name)
    assert "hook wtcore_update_started of plugin 'exploding' raised; ignored" in caplog.text


def test_register_twice_is_an_error(observer: Observer) -> None:
    with pytest.raises(PluginLoadError, match="already registered") as exc:
        wt_hooks.register_hooks(observer, name="test-observer")
    assert exc.value.reason == "conflict"


class Greeter:
    @hookimpl
    def wtcore_add_commands(self, subparsers: argparse._SubParsersAction[Any]) -> None:
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)


def test_plugins_add_cli_commands(capsys: pytest.CaptureFixture[str]) -> None:
    name = wt_hooks.register_hooks(Greeter(), name="greeter")
    try:
        assert main(["hello", "--name", "wtcore"]) == 3
    finally:
        wt_hooks.unregister_hooks(name=name)
    assert capsys.readouterr().out == "hello wtcore\n"


def test_broken_hook_plugin_is_reported_with_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    info = tmp_path / "badhooks-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: badhooks\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[wtcore.hooks]\nbad = badhooks_mod\n")
    (tmp_path / "badhooks_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wt_hooks.reset()
    try:
        errors = wt_hooks.hook_load_errors()
        assert any(
            "hook plugin 'bad' from badhooks 0.3 failed to load badhooks_mod" in str(e)
            and "boom at import" in str(e)
            for e in errors
        ), errors
        assert main(["plugins"]) == 1  # anything broken makes `wtcore plugins` fail
        out = capsys.readouterr().out
        assert re.search(r"BROKEN +hook plugin 'bad' from badhooks 0.3", out), out
    finally:
        monkeypatch.undo()
        wt_hooks.reset()
