"""Renamed for 0.2.0, old names kept until 0.3: the ``local`` engine is ``inline``, ``wtcore.guards``
is ``wtcore.finite``. The old engine name runs the same rounds, bit for bit, with one
``DeprecationWarning`` per lookup naming the new one; the old modules forward to the same
objects (tested with the other 0.1.0 paths, ``test_old_paths.py``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from wtcore import (
    ENGINES,
    TRAINER_ENGINES,
    ModuleSink,
    PluginLoadError,
    TensorSource,
    WeightSyncWorker,
    trainer_from_config,
)
from wtcore.registry import Registry
from wtcore.testing import build_module, mixed_dtype_state, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inline import InlineTrainerEngine, InlineWorkerEngine
from wtcore_kit.inproc import InProcessClient

RENAMED = r"'local' was renamed 'inline'; the old name will be removed in 0\.3"


@contextmanager
def _deprecations() -> Iterator[list[str]]:
    """Every DeprecationWarning raised inside, as text (and nothing else may warn)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen: list[str] = []
        yield seen
    seen += [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(seen) == len(caught), [str(w.message) for w in caught]


def test_the_registries_resolve_the_old_name_to_the_new_with_a_warning() -> None:
    for registry, cls in ((ENGINES, InlineWorkerEngine), (TRAINER_ENGINES, InlineTrainerEngine)):
        with pytest.warns(DeprecationWarning, match=RENAMED):
            assert registry.load("local") is cls
        with pytest.warns(DeprecationWarning, match=RENAMED):
            assert registry.info("local") == registry.info("inline")
        with pytest.warns(DeprecationWarning, match=RENAMED):
            assert registry.resolve("local") == "inline"
        assert registry.resolve("inline") == "inline"
        assert "inline" in registry.names() and "local" not in registry.names()
        assert registry.renamed == {"local": "inline"}


def test_the_old_engine_name_syncs_bit_exact_with_one_warning_per_side() -> None:
    """Worker and trainer configured by the old name: the same round as the new name gives."""
    state = mixed_dtype_state()
    with _deprecations() as seen:
        model = build_module(zeros_like_state(state))
        worker = WeightSyncWorker("local", ModuleSink(model))
        engine = trainer_from_config(
            {"backend": "local", "packed_buffer_size_bytes": 256},
            client=InProcessClient([worker]),
            source=TensorSource(state),
        )
        assert isinstance(engine, InlineTrainerEngine)
        assert isinstance(worker.engine, InlineWorkerEngine)
        engine.send_weights(weight_version="old-name", verify=True)
    assert_state_equal(model, state)
    assert worker.weight_info()["weight_version"] == "old-name"
    assert len(seen) == 2 and all("engine 'local' was renamed 'inline'" in m for m in seen), seen
    assert "trainer engine" in seen[1]


def test_a_typo_of_the_old_name_suggests_the_new() -> None:
    with pytest.raises(PluginLoadError, match="Did you mean 'inline'"):
        ENGINES.load("lokal")


def test_the_old_name_is_still_taken() -> None:
    """Registering ``local`` at runtime would silently shadow the alias: it needs replace=True,
    and then the runtime registration wins, without a warning."""
    reg: Registry[object] = Registry(
        "wtcore.test_renamed",
        "wtcore.engine:WeightTransferEngine",
        "engine",
        builtins={"inline": "wtcore_kit.inline:InlineWorkerEngine"},
        renamed={"local": "inline"},
    )
    with pytest.raises(PluginLoadError, match="'local' is already registered"):
        reg.register("local", InlineWorkerEngine)
    reg.register("local", InlineWorkerEngine, replace=True)
    assert reg.load("local") is InlineWorkerEngine  # no warning: filterwarnings = error


def test_the_old_modules_export_what_the_new_ones_do() -> None:
    """The forwarding itself is tested with the other 0.1.0 paths (test_old_paths.py)."""
    import wtcore.finite
    import wtcore.guards
    import wtcore.local
    import wtcore_kit.inline

    assert sorted(wtcore.local.__all__) == sorted(
        f"Local{n[6:]}" for n in wtcore_kit.inline.__all__
    )
    assert wtcore.guards.__all__ == wtcore.finite.__all__


def test_wtcore_plugins_lists_the_new_name_and_the_old_as_deprecated() -> None:
    from wtcore.inventory import collect, render

    record = collect()
    engines = record["registries"][0]
    assert "inline" in [p["name"] for p in engines["plugins"]]
    assert "local" not in [p["name"] for p in engines["plugins"]]
    assert engines["renamed"] == [{"name": "local", "new": "inline"}]
    assert record["registries"][2]["renamed"] == []  # clients: nothing renamed
    lines = render(record)
    assert (
        sum(
            bool(re.fullmatch(r"  local +deprecated name of 'inline' \(until 0\.3\)", ln))
            for ln in lines
        )
        == 2
    )


def test_a_plugin_may_not_take_the_old_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution registering ``local`` would be shadowed by the alias without a word: it is
    a built-in conflict instead (``wtcore plugins`` exits 1), and ``local`` stays ``inline``."""
    info = tmp_path / "squatter-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: squatter\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[wtcore.backends]\nlocal = squatter:ENGINE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry(
        "wtcore.backends",
        "wtcore.engine:WeightTransferEngine",
        "engine",
        builtins={"inline": "wtcore_kit.inline:InlineWorkerEngine"},
        renamed={"local": "inline"},
    )
    assert "local" not in reg.names()
    (conflict,) = reg.conflicts()
    assert conflict.name == "local" and conflict.builtin
    assert [p.distribution for p in conflict.providers] == ["wtcore", "squatter"]
    assert "may not shadow a built-in name" in conflict.message
    with pytest.warns(DeprecationWarning, match=RENAMED):
        assert reg.load("local") is InlineWorkerEngine
