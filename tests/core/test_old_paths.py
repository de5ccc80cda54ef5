"""0.1.0's module paths that moved in 0.2.0 forward every 0.1.0 name until 0.3.

Importing an old path warns nothing; each name asked of it warns once
and is the new module's object. Old paths of modules that were never released are gone, and
``import wtcore`` installs no import hook.
"""

from __future__ import annotations

import importlib
import sys

import pytest

#: Each old path of 0.1.0: its new module and 0.1.0's ``__all__`` there (less ``renamed_fields``,
#: which served only the field names 0.1.0 deprecated for removal in 0.2.0).
OLD_PATHS: dict[str, tuple[str, list[str]]] = {
    old: (new, names.split())
    for old, new, names in [
        (
            "wtcore.bench",
            "wtcore_bench",
            "Baseline BaselineContext BenchNotSupportedError BenchOptions EngineBench ModelSpec "
            "OptionalDependencyError ReceiverFleet ReceiverLauncher run_bench",
        ),
        ("wtcore.concurrency", "wtcore_kit.concurrency", "BackgroundCall"),
        (
            "wtcore.fanout",
            "wtcore_kit.fanout",
            "DEFAULT_TIMEOUT_S FAIL_FAST_S FanOutClient failure_of fan_out",
        ),
        ("wtcore.guards", "wtcore.finite", "FiniteCheckSink"),
        ("wtcore.inproc", "wtcore_kit.inproc", "InProcessClient"),
        (
            "wtcore.kit",
            "wtcore_kit.bucketed",
            "BucketUpdateInfo BucketedTrainerEngine BucketedTrainerInitInfo BucketedWorkerEngine "
            "check_bucket_options",
        ),
        (
            "wtcore.local",
            "wtcore_kit.inline",
            "LocalInitInfo LocalTrainerEngine LocalTrainerInitInfo LocalUpdateInfo LocalWorkerEngine",
        ),
        ("wtcore.net", "wtcore.testing.net", "free_port"),
        ("wtcore.procs", "wtcore.testing.procs", "stop_processes"),
        (
            "wtcore.synthetic",
            "wtcore_kit.synthetic",
            "build_module synthetic_state zeros_like_state",
        ),
        ("wtcore.testing.cluster", "wtcore_bench.netns", "Cluster Node cluster unavailable_reason"),
        ("wtcore_http_client.process", "wtcore_bench.serve", "ServeProcess launch_serve"),
    ]
}


def _new_name(old: str, name: str) -> str:
    return f"Inline{name[5:]}" if old == "wtcore.local" else name


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [(old, new, name) for old, (new, names) in OLD_PATHS.items() for name in names],
)
def test_each_0_1_0_name_forwards_with_one_warning(old: str, new: str, name: str) -> None:
    module = importlib.import_module(old)  # filterwarnings = error: importing warns nothing
    target = _new_name(old, name)
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} moved to {new}\.{target};") as w:
        value = getattr(module, name)
    assert len(w) == 1
    assert value is getattr(importlib.import_module(new), target)
    assert name in module.__all__  # ``import *`` forwards it too


def test_a_star_import_binds_the_old_names_to_the_new_objects() -> None:
    ns: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=r"wtcore\.local\.Local\w+ moved"):
        exec("from wtcore.local import *", ns)
    inline = importlib.import_module("wtcore_kit.inline")
    assert ns["LocalTrainerEngine"] is inline.InlineTrainerEngine
    assert "InlineTrainerEngine" not in ns


def test_a_name_the_new_module_does_not_export_is_an_attribute_error() -> None:
    module = importlib.import_module("wtcore.bench")
    with pytest.raises(AttributeError, match="'wtcore.bench' has no attribute 'nope'"):
        module.nope  # noqa: B018


def test_a_missing_distribution_names_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from wtcore.errors import PluginLoadError

    monkeypatch.setitem(sys.modules, "wtcore_bench", None)  # as if not installed
    module = importlib.import_module("wtcore.bench")
    with pytest.raises(PluginLoadError, match=r"moved to wtcore_bench.*pip install wtcore-bench"):
        module.EngineBench  # noqa: B018


@pytest.mark.parametrize(
    "old",
    [
        *("wtcore._parse", "wtcore.netns", "wtcore.bucketed", "wtcore.pairs", "wtcore.inline"),
        *("wtcore.delta", "wtcore_tcp.stream", "wtcore_nccl.forward", "wtcore_nccl.frames"),
        "wtcore_nccl.pipeline",
        *("wtcore.layout", "wtcore.plan", "wtcore.receiver_layout", "wtcore.sharded_round"),
        *("wtcore_kit.pairs", "wtcore_kit.schedule"),
    ],
)
def test_paths_that_were_never_public_in_a_release_are_gone(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_import_wtcore_installs_no_import_hook() -> None:
    import wtcore

    assert wtcore.__name__ == "wtcore"
    ours = [
        f for f in sys.meta_path if type(f).__module__.split(".")[0] in {"wtcore", "wtcore_kit"}
    ]
    assert ours == []
