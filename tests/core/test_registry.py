"""Lazy entry-point registries: discovery, registration and every error message."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from wtcore import ENGINES, PluginLoadError, PluginNotFoundError, Registry, WeightTransferEngine
from wtcore.local import LocalWorkerEngine

FIXTURE_ENTRY_POINTS = """\
[wtcore.engines]
fake = fakeplug_mod:FakeEngine
broken = fakeplug_broken:Engine
notanengine = fakeplug_mod:NotAnEngine
"""


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A distribution 'fakeplug 1.2.3' made of a *.dist-info folder on sys.path; no pip."""
    info = tmp_path / "fakeplug-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(FIXTURE_ENTRY_POINTS)
    (tmp_path / "fakeplug_mod.py").write_text(
        textwrap.dedent(
            """
            from wtcore.local import LocalWorkerEngine

            class FakeEngine(LocalWorkerEngine):
                pass

            class NotAnEngine:
                pass
            """
        )
    )
    (tmp_path / "fakeplug_broken.py").write_text("import module_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path


def _registry() -> Registry[WeightTransferEngine[object, object]]:
    return Registry(
        "wtcore.engines",
        WeightTransferEngine,
        "engine",
        builtins={"local": "wtcore.local:LocalWorkerEngine"},
    )


def test_discovery_through_a_fixture_distribution(fake_dist: Path) -> None:
    import sys

    reg = _registry()
    assert {"fake", "broken", "notanengine", "local"} <= set(reg.names())
    assert "fakeplug_mod" not in sys.modules  # listing imports nothing
    info = reg.info("fake")
    assert (info.distribution, info.version, info.target) == (
        "fakeplug",
        "1.2.3",
        "fakeplug_mod:FakeEngine",
    )
    cls = reg.load("fake")
    assert cls.__name__ == "FakeEngine" and issubclass(cls, LocalWorkerEngine)
    assert "fakeplug_mod" in sys.modules


def test_broken_plugin_names_distribution_version_and_cause(fake_dist: Path) -> None:
    reg = _registry()
    with pytest.raises(PluginLoadError) as exc:
        reg.load("broken")
    text = str(exc.value)
    assert "engine 'broken' from fakeplug 1.2.3 failed to import fakeplug_broken:Engine" in text
    assert "ModuleNotFoundError" in text and "module_that_does_not_exist" in text
    assert isinstance(exc.value.__cause__, ModuleNotFoundError)


def test_wrong_base_is_a_type_error(fake_dist: Path) -> None:
    reg = _registry()
    with pytest.raises(
        TypeError,
        match=r"engine 'notanengine' \(fakeplug 1.2.3\) must be a subclass of wtcore.engine.WeightTransferEngine",
    ):
        reg.load("notanengine")
    with pytest.raises(TypeError, match="must be a subclass"):
        reg.register("x", dict)  # type: ignore[arg-type]


def test_unknown_name_lists_installed_and_suggests() -> None:
    reg = _registry()
    reg.register("gloo_fast", LocalWorkerEngine)
    with pytest.raises(PluginNotFoundError) as exc:
        reg.load("gloo_fats")
    text = str(exc.value)
    assert (
        "unknown engine 'gloo_fats'; installed:" in text and "gloo_fast" in text and "local" in text
    )
    assert "Did you mean 'gloo_fast'?" in text
    assert "pip install wtcore-gloo-fats" in text


def test_first_party_name_names_its_distribution() -> None:
    reg = Registry("wtcore.nonexistent_group", WeightTransferEngine, "engine")
    with pytest.raises(
        PluginNotFoundError, match=r"'nccl' is provided by wtcore-nccl: pip install wtcore-nccl"
    ):
        reg.load("nccl")
    with pytest.raises(
        PluginNotFoundError, match=r"provided by wtcore-http-client: pip install wtcore-http-client"
    ):
        Registry("wtcore.nonexistent_group", object, "client").load("http")


def test_register_clash_and_replace() -> None:
    reg = _registry()
    with pytest.raises(
        ValueError,
        match=r"engine 'local' is already registered \(wtcore.local:LocalWorkerEngine, wtcore .*\); pass replace=True",
    ):
        reg.register("local", LocalWorkerEngine)
    reg.register("mine", "wtcore.local:LocalWorkerEngine")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("mine", LocalWorkerEngine)
    reg.register("mine", LocalWorkerEngine, replace=True)
    assert reg.load("mine") is LocalWorkerEngine
    reg.unregister("mine")
    assert "mine" not in reg.names()
    with pytest.raises(ValueError, match="must look like 'package.module:Class'"):
        reg.register("bad", "no_colon_here")


def test_disable_autoload(fake_dist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WTCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = _registry()
    assert reg.names() == ["local"]  # built-ins stay, entry points are not read
    with pytest.raises(PluginNotFoundError, match="plugin discovery is off"):
        reg.load("fake")
    reg.register("fake", "fakeplug_mod:FakeEngine")  # explicit registration still works
    assert reg.load("fake").__name__ == "FakeEngine"


def test_refresh_sees_newly_installed_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = _registry()
    assert "fake" not in reg.names()
    info = tmp_path / "late-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[wtcore.engines]\nfake = wtcore.local:LocalWorkerEngine\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg.refresh()
    assert "fake" in reg.names()


def test_real_editable_plugins_are_discovered() -> None:
    from importlib.metadata import distributions

    installed = {d.metadata["Name"] for d in distributions()}
    for name, dist in (("nccl", "wtcore-nccl"), ("ipc", "wtcore-ipc")):
        if dist in installed and name in ENGINES.names():
            assert ENGINES.info(name).distribution == dist
    assert ENGINES.info("local").distribution == "wtcore"
