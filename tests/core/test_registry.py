"""Lazy entry-point registries: discovery, registration and every error message."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from wtcore import (
    ENGINES,
    PayloadError,
    PluginLoadError,
    Registry,
    WeightTransferEngine,
    WtcoreError,
)
from wtcore_kit.inline import InlineWorkerEngine

FIXTURE_ENTRY_POINTS = """\
[wtcore.backends]
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
            from wtcore_kit.inline import InlineWorkerEngine

            class FakeEngine(InlineWorkerEngine):
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
        "wtcore.backends",
        WeightTransferEngine,
        "engine",
        builtins={"inline": "wtcore_kit.inline:InlineWorkerEngine"},
        half="worker",
    )


def test_discovery_through_a_fixture_distribution(fake_dist: Path) -> None:
    reg = _registry()
    assert {"fake", "broken", "notanengine", "inline"} <= set(reg.names())
    assert "fakeplug_mod" not in sys.modules  # listing imports nothing
    info = reg.info("fake")
    assert (info.distribution, info.version, info.target) == (
        "fakeplug",
        "1.2.3",
        "fakeplug_mod:FakeEngine",
    )
    cls = reg.load("fake")
    assert cls.__name__ == "FakeEngine" and issubclass(cls, InlineWorkerEngine)
    assert "fakeplug_mod" in sys.modules


def test_broken_plugin_names_distribution_version_and_cause(fake_dist: Path) -> None:
    reg = _registry()
    with pytest.raises(PluginLoadError) as exc:
        reg.load("broken")
    assert exc.value.reason == "import"
    text = str(exc.value)
    assert "engine 'broken' from fakeplug 1.2.3 failed to import fakeplug_broken:Engine" in text
    assert "ModuleNotFoundError" in text and "module_that_does_not_exist" in text
    assert isinstance(exc.value.__cause__, ModuleNotFoundError)


def test_wrong_base_is_a_wrong_type_load_error(fake_dist: Path) -> None:
    reg = _registry()
    with pytest.raises(
        PluginLoadError,
        match=r"engine 'notanengine' \(fakeplug 1.2.3\) must be a subclass of wtcore.engine.WeightTransferEngine",
    ) as exc:
        reg.load("notanengine")
    assert exc.value.reason == "wrong-type"
    with pytest.raises(PluginLoadError, match="must be a subclass") as exc:
        reg.register("x", dict)  # type: ignore[arg-type]
    assert isinstance(exc.value, WtcoreError) and exc.value.reason == "wrong-type"


def test_unknown_name_lists_installed_and_suggests_no_guessed_install() -> None:
    reg = _registry()
    reg.register("gloo_fast", InlineWorkerEngine)
    with pytest.raises(PluginLoadError) as exc:
        reg.load("gloo_fats")
    text = str(exc.value)
    assert (
        "unknown engine 'gloo_fats'; installed:" in text
        and "gloo_fast" in text
        and "inline" in text
    )
    assert "Did you mean 'gloo_fast'?" in text
    assert "pip install" not in text  # never `pip install wtcore-<typo>`: typosquatting bait
    assert isinstance(exc.value, LookupError) and exc.value.reason == "not-found"


def test_first_party_name_names_its_distribution() -> None:
    reg = Registry("wtcore.backends", WeightTransferEngine, "engine")
    reg._discovered = {}  # as if no plugin were installed, without touching the environment
    with pytest.raises(
        PluginLoadError, match=r"'nccl' is provided by wtcore-nccl: pip install wtcore-nccl"
    ):
        reg.load("nccl")
    clients = Registry("wtcore.clients", object, "client")
    clients._discovered = {}
    with pytest.raises(
        PluginLoadError, match=r"provided by wtcore-http-client: pip install wtcore-http-client"
    ):
        clients.load("http")


def test_a_typo_of_a_first_party_name_suggests_it_and_its_install_line() -> None:
    reg = Registry("wtcore.backends", WeightTransferEngine, "engine")
    reg._discovered = {}
    with pytest.raises(PluginLoadError) as exc:
        reg.load("ncl")
    text = str(exc.value)
    assert "Did you mean 'nccl'? It is provided by wtcore-nccl: pip install wtcore-nccl" in text
    assert "wtcore-ncl" not in text


def test_first_party_names_are_per_group() -> None:
    reg = Registry("wtcore.backends", WeightTransferEngine, "engine")
    reg._discovered = {}
    with pytest.raises(PluginLoadError) as exc:
        reg.load("http")  # a client name, not an engine name
    assert "pip install" not in str(exc.value)


def test_register_clash_and_replace() -> None:
    reg = _registry()
    with pytest.raises(
        PluginLoadError,
        match=r"engine 'inline' is already registered \(wtcore_kit.inline:InlineWorkerEngine, wtcore .*\); pass replace=True",
    ):
        reg.register("inline", InlineWorkerEngine)
    reg.register("mine", "wtcore_kit.inline:InlineWorkerEngine")
    with pytest.raises(PluginLoadError, match="already registered") as exc:
        reg.register("mine", InlineWorkerEngine)
    assert exc.value.reason == "conflict"
    reg.register("mine", InlineWorkerEngine, replace=True)
    assert reg.load("mine") is InlineWorkerEngine
    reg.unregister("mine")
    assert "mine" not in reg.names()
    with pytest.raises(PayloadError, match="must look like 'package.module:Class'"):
        reg.register("bad", "no_colon_here")


def test_disable_autoload(fake_dist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WTCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = _registry()
    assert reg.names() == ["inline"]  # built-ins stay, entry points are not read
    with pytest.raises(PluginLoadError, match="plugin discovery is off"):
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
        "[wtcore.backends]\nfake = wtcore_kit.inline:InlineWorkerEngine\n"
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
    assert ENGINES.info("inline").distribution == "wtcore"


# ---------------------------------------------------------------------- conflicts
def _write_dist(
    where: Path, name: str, version: str, entry_points: str, *, folder: str | None = None
) -> None:
    """A real distribution: a ``*.dist-info`` folder that importlib.metadata finds on sys.path."""
    info = where / (folder or f"{name.replace('-', '_')}-{version}.dist-info")
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def two_quic_dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _write_dist(tmp_path, "quic-one", "1.0", "[wtcore.backends]\nquic = quic_one:Engine\n")
    _write_dist(tmp_path, "quic-two", "2.0", "[wtcore.backends]\nquic = quic_two:Engine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_two_distributions_one_name_is_an_error_naming_both(two_quic_dists: Path) -> None:
    reg = _registry()
    assert "quic" in reg.names()  # listed (imports nothing), but not usable
    with pytest.raises(PluginLoadError) as exc:
        reg.load("quic")
    text = str(exc.value)
    assert "engine 'quic' is registered in wtcore.backends by 2 distributions" in text
    assert "quic-one 1.0 (quic_one:Engine)" in text and "quic-two 2.0 (quic_two:Engine)" in text
    assert isinstance(exc.value, WtcoreError) and exc.value.reason == "conflict"
    with pytest.raises(PluginLoadError, match="by 2 distributions"):
        reg.info("quic")
    (conflict,) = reg.conflicts()
    assert conflict.name == "quic" and not conflict.builtin
    assert {p.distribution for p in conflict.providers} == {"quic-one", "quic-two"}


def test_registering_at_runtime_settles_a_conflict(two_quic_dists: Path) -> None:
    reg = _registry()
    with pytest.raises(PluginLoadError, match="already registered"):
        reg.register("quic", InlineWorkerEngine)
    reg.register("quic", InlineWorkerEngine, replace=True)
    assert reg.load("quic") is InlineWorkerEngine and reg.conflicts() == []


def test_a_plugin_may_not_shadow_a_builtin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The built-in wins (issue 29, item 10): a distribution registering ``inline`` used to
    make every use of the built-in raise; now it is ignored with a warning, once, and still
    listed as a conflict (``wtcore plugins`` exits 1)."""
    _write_dist(tmp_path, "shadow", "0.3", "[wtcore.backends]\ninline = shadow_mod:Engine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = _registry()
    with caplog.at_level("WARNING", logger="wtcore.registry"):
        assert reg.load("inline") is InlineWorkerEngine
        assert reg.load("inline") is InlineWorkerEngine
    (record,) = caplog.records
    text = record.getMessage()
    assert "engine 'inline' is built into wtcore (wtcore_kit.inline:InlineWorkerEngine)" in text
    assert "shadow 0.3 (shadow_mod:Engine) also registers it" in text
    assert "may not shadow a built-in name, so it is ignored and the built-in is used" in text
    assert "Uninstall shadow" in text
    (conflict,) = reg.conflicts()
    assert conflict.builtin and conflict.providers[0].distribution == "wtcore"


def test_one_distribution_seen_twice_is_not_a_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An editable install seen through two sys.path entries: the same distribution twice.
    eps = "[wtcore.backends]\ntwice = wtcore_kit.inline:InlineWorkerEngine\n"
    _write_dist(tmp_path / "a", "Twice_Dist", "1.0", eps)
    # a folder name importlib.metadata does not recognise as the same (its own de-duplication)
    _write_dist(tmp_path / "b", "twice-dist", "1.0", eps, folder="twice_dist_dev-1.0.dist-info")
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    reg = _registry()
    assert reg.conflicts() == []
    assert reg.load("twice") is InlineWorkerEngine
    assert reg.info("twice").distribution in {"Twice_Dist", "twice-dist"}


def test_the_real_registries_have_no_conflicts() -> None:
    from wtcore import CLIENTS, TRAINER_ENGINES

    for reg in (ENGINES, TRAINER_ENGINES, CLIENTS):
        assert reg.conflicts() == [], [c.message for c in reg.conflicts()]


# ---------------------------------------------------------------------- one record, two halves
RECORD = """\
from wtcore.registry import Halves

ENGINE = Halves(trainer="recplug_trainer:Trainer", worker="recplug_worker:Worker")
"""


@pytest.fixture
def record_dist(tmp_path: Path) -> Iterator[Path]:
    """wtcore-recplug: one ``wtcore.backends`` record whose halves live in two modules; the
    global registries see it, then forget it."""
    from wtcore import TRAINER_ENGINES

    (tmp_path / "recplug.py").write_text(RECORD)
    (tmp_path / "recplug_worker.py").write_text(
        "from wtcore_kit.inline import InlineWorkerEngine as Worker\n"
    )
    (tmp_path / "recplug_trainer.py").write_text(
        "from wtcore_kit.inline import InlineTrainerEngine as Trainer\n"
    )
    _write_dist(tmp_path, "wtcore-recplug", "1.0", "[wtcore.backends]\nrec = recplug:ENGINE\n")
    sys.path.insert(0, str(tmp_path))
    for reg in (ENGINES, TRAINER_ENGINES):
        reg.refresh()
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for module in ("recplug", "recplug_worker", "recplug_trainer"):
            sys.modules.pop(module, None)
        for reg in (ENGINES, TRAINER_ENGINES):
            reg.refresh()


def test_one_record_names_both_halves_and_each_loads_only_its_own(record_dist: Path) -> None:
    from wtcore import TRAINER_ENGINES
    from wtcore_kit.inline import InlineTrainerEngine

    assert "rec" in ENGINES.names() and "rec" in TRAINER_ENGINES.names()
    assert ENGINES.info("rec").target == "recplug:ENGINE"
    assert "recplug" not in sys.modules  # listing reads metadata only
    assert ENGINES.load("rec") is InlineWorkerEngine
    assert "recplug_worker" in sys.modules and "recplug_trainer" not in sys.modules
    assert TRAINER_ENGINES.load("rec") is InlineTrainerEngine


def test_a_record_whose_half_is_missing_names_that_half(record_dist: Path) -> None:
    (record_dist / "recplug_worker.py").unlink()
    with pytest.raises(PluginLoadError) as exc:
        ENGINES.load("rec")
    assert "engine 'rec' from wtcore-recplug 1.0 failed to import recplug_worker:Worker" in str(
        exc.value
    )
