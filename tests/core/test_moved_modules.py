"""The modules that left the core keep their old import paths for one release, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = [
    ("wtcore.bench", "wtcore_bench", "EngineBench"),
    ("wtcore.netns", "wtcore_bench.netns", "cluster"),
    ("wtcore.net", "wtcore.testing.net", "free_port"),
    ("wtcore.delta.realistic", "wtcore.testing.realistic", "realistic_steps"),
    ("wtcore.testing.cluster", "wtcore_bench.netns", "Cluster"),
    ("wtcore._parse", "wtcore.parse", "parse_dataclass"),
    ("wtcore.kit", "wtcore_kit.bucketed", "BucketedTrainerEngine"),
    ("wtcore.kit", "wtcore_kit.bucketed", "check_bucket_options"),
    ("wtcore.bucketed", "wtcore_kit.bucketed", "BucketedWorkerEngine"),
    ("wtcore.fanout", "wtcore_kit.fanout", "FanOutClient"),
    ("wtcore.concurrency", "wtcore_kit.concurrency", "BackgroundCall"),
    ("wtcore.pairs", "wtcore_kit.pairs", "PlanReceiver"),
    ("wtcore.inline", "wtcore_kit.inline", "InlineTrainerEngine"),
    ("wtcore.inproc", "wtcore_kit.inproc", "InProcessClient"),
    ("wtcore.synthetic", "wtcore_kit.synthetic", "synthetic_state"),
    ("wtcore.guards", "wtcore.finite", "FiniteCheckSink"),
    ("wtcore.guards", "wtcore.finite", "is_all_finite"),
    ("wtcore.delta.codec", "wtcore_delta.codec", "bits"),
    ("wtcore.delta.header", "wtcore_delta.header", "DeltaHeader"),
    ("wtcore.delta.receiver", "wtcore_delta.receiver", "DeltaSink"),
    ("wtcore.delta.trainer", "wtcore_delta.trainer", "DeltaRounds"),
    ("wtcore.procs", "wtcore.testing.procs", "stop_processes"),
    ("wtcore_http_client.process", "wtcore_bench.serve", "launch_serve"),
]
#: Modules renamed with their names: (old module, new module, old name, new name).
RENAMED = [
    ("wtcore.local", "wtcore_kit.inline", f"Local{part}", f"Inline{part}")
    for part in ("InitInfo", "TrainerEngine", "TrainerInitInfo", "UpdateInfo", "WorkerEngine")
]


@pytest.mark.parametrize(("old", "new", "name", "new_name"), [(*m, m[2]) for m in MOVED] + RENAMED)
def test_the_old_path_forwards_with_a_warning(old: str, new: str, name: str, new_name: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{new_name};"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), new_name)
    assert name in getattr(module, "__all__", [name])  # ``import *`` forwards it too


def test_a_name_the_new_module_does_not_export_is_an_attribute_error() -> None:
    module = importlib.import_module("wtcore.bench")
    with pytest.raises(AttributeError, match="'wtcore.bench' has no attribute 'nope'"):
        module.nope  # noqa: B018


def test_a_missing_distribution_names_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from wtcore.errors import PluginLoadError

    monkeypatch.setitem(sys.modules, "wtcore_bench", None)  # as if not installed
    module = importlib.import_module("wtcore.bench")
    with pytest.raises(PluginLoadError, match=r"moved to wtcore_bench.*pip install wtcore-bench"):
        module.EngineBench  # noqa: B018


def test_a_missing_wtcore_delta_names_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from wtcore.errors import PluginLoadError

    monkeypatch.setitem(sys.modules, "wtcore_delta.codec", None)  # as if not installed
    module = importlib.import_module("wtcore.delta.codec")
    with pytest.raises(
        PluginLoadError, match=r"moved to wtcore_delta.codec.*pip install wtcore-delta"
    ):
        module.bits  # noqa: B018


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("wtcore_nccl.forward", "wtcore_nccl.chain", "Chain"),
        ("wtcore_nccl.pipeline", "wtcore_channel.pipeline", "BufferPool"),
        ("wtcore_nccl.frames", "wtcore_channel.frames", "make_header"),
        ("wtcore_tcp.stream", "wtcore_channel.stream", "Stream"),
    ],
)
def test_nccl_internals_that_moved_forward_with_one_warning(old: str, new: str, name: str) -> None:
    """nccl's pipeline and frames are the streamed kit's (wtcore-channel), its forward is its
    chain: the old module warns once, on import, and gives the same objects."""
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is {new} since wtcore 0\.2") as caught:
        module = importlib.import_module(old)
    assert len(caught) == 1
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    assert name in module.__all__


def test_a_star_import_of_an_old_path_forwards_every_name() -> None:
    """``from wtcore.local import *`` still binds the old names, each to the new object."""
    ns: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=r"wtcore\.local\.Local\w+ moved"):
        exec("from wtcore.local import *", ns)
    inline = importlib.import_module("wtcore_kit.inline")
    assert ns["LocalTrainerEngine"] is inline.InlineTrainerEngine
    assert "InlineTrainerEngine" not in ns
