"""A third-party engine pair written against wtcore 0.1, installed as a real distribution.

0.2 re-runs the init handshake after any failed round, through the trainer engine's
``worker_init_info()``, a method 0.1 did not have. An engine without it used to pass the first
14 cases of the contract suite and fail the 4 recovery cases deep in a round with
``NotImplementedError``. Now the registry refuses it when it is registered or first loaded,
naming the engine, the missing method and the upgrade notes (CHANGELOG.md, 0.2.0, "For plugin
authors"), and ``wtcore plugins`` lists it as broken. The same engine with the CHANGELOG's
changes applied passes the whole contract suite.

Each distribution is a package and a ``*.dist-info`` folder (METADATA, entry_points.txt) in a
temporary directory put on ``sys.path``, as pip would leave them; the global registries are
refreshed on the way in and out, so no other test sees them.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import wtcore
from wtcore import (
    ENGINES,
    TRAINER_ENGINES,
    ModuleSink,
    PluginLoadError,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSyncWorker,
    WeightTransferEngine,
    WeightTransferTrainerFactory,
    trainer_from_config,
)
from wtcore.source import TensorSource
from wtcore.stats import TransferStats
from wtcore.testing.contract import EngineContractSuite, assert_state_equal
from wtcore.testing.recording import RecordingClient
from wtcore.testing.sources import build_module, mixed_dtype_state, zeros_like_state
from wtcore_kit.inproc import InProcessClient

ROOT = Path(__file__).resolve().parents[2]

#: A complete engine pair as a plugin author wrote it for wtcore 0.1 (docs/writing-an-engine.md
#: of 0.1: its own ``trainer_init`` that initializes the workers, and ``_send``). Each bucket
#: travels base64-encoded inside its ``update_info``. ``{name}`` is the registry name.
ENGINE_0_1 = '''\
"""wtcore plugin: buckets as base64 inside the control-plane payload (wtcore 0.1 API)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import ClassVar

import torch

from wtcore import PayloadError, TrainerInitInfo, TrainerWeightTransferEngine, WeightTransferEngine
from wtcore.buckets import max_bucket_nbytes, pack_source, plan_buckets, unpack_bucket
from wtcore.meta import metas_from_wire, metas_to_wire


@dataclass
class B64TrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "{name}"
    buffer_size_bytes: int = 1 << 20


@dataclass
class B64InitInfo:
    buffer_size_bytes: int


@dataclass
class B64UpdateInfo:
    data: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        self.metas = metas_from_wire(self.names, self.dtype_names, self.shapes)


class B64WorkerEngine(WeightTransferEngine[B64InitInfo, B64UpdateInfo]):
    init_info_cls = B64InitInfo
    update_info_cls = B64UpdateInfo

    def init_transfer_engine(self, init_info):
        self.settings = init_info

    def receive_weights(self, update_info):
        buckets = plan_buckets(update_info.metas, self.settings.buffer_size_bytes)
        if len(buckets) > 1:
            raise PayloadError("update_info: more tensors than one bucket holds")
        raw = bytearray(base64.b64decode(update_info.data, validate=True))
        if len(raw) != max_bucket_nbytes(buckets):
            raise PayloadError(f"update_info: {len(raw)} bytes, expected {max_bucket_nbytes(buckets)}")
        if buckets:
            buf = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            self.sink.load_weights(list(unpack_bucket(buckets[0], buf)))


class B64TrainerEngine(TrainerWeightTransferEngine):
    init_info_cls = B64TrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if init_info.is_sender:
            client.init_weight_transfer_engine({"buffer_size_bytes": init_info.buffer_size_bytes})
        return cls(init_info, client=client, source=source)

    def _send(self, source, stats):
        metas = source.metadata()
        buckets = plan_buckets(metas, self.init_info.buffer_size_bytes)
        staging = torch.empty(max_bucket_nbytes(buckets), dtype=torch.uint8)
        stats.num_tensors, stats.num_bytes = len(metas), sum(m.nbytes for m in metas)
        with stats.phase("control"):
            self.client.start_weight_update()
        for bucket, filled in pack_source(source, metas, buckets, lambda b: staging, stats):
            data = base64.b64encode(filled.numpy().tobytes()).decode("ascii")
            with stats.phase("wire"):
                self.client.update_weights({"data": data, **metas_to_wire(bucket.metas)})
            stats.num_buckets += 1
        with stats.phase("control"):
            self.client.finish_weight_update(stats.weight_version)
'''

#: The 0.1 ``trainer_init``, and what CHANGELOG.md (0.2.0, "For plugin authors") says to write
#: instead: the default ``trainer_init`` ships ``worker_init_info()`` at init and again after
#: every failed round.
TRAINER_INIT_0_1 = """\
    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if init_info.is_sender:
            client.init_weight_transfer_engine({"buffer_size_bytes": init_info.buffer_size_bytes})
        return cls(init_info, client=client, source=source)
"""
WORKER_INIT_INFO_0_2 = """\
    def worker_init_info(self):
        return {"buffer_size_bytes": self.init_info.buffer_size_bytes}
"""
#: And the 0.1 ``_send``'s own start and finish: in 0.2 ``send_weights`` opens the round and
#: finishes it with its ``weight_version`` (``TransferStats`` no longer has one); ``_send``
#: only moves the bytes.
ROUND_CALLS_0_1 = (
    """\
        with stats.phase("control"):
            self.client.start_weight_update()
""",
    """\
        with stats.phase("control"):
            self.client.finish_weight_update(stats.weight_version)
""",
)
assert ENGINE_0_1.count(TRAINER_INIT_0_1) == 1
assert all(ENGINE_0_1.count(c) == 1 for c in ROUND_CALLS_0_1)
ENGINE_0_2 = ENGINE_0_1.replace(TRAINER_INIT_0_1, WORKER_INIT_INFO_0_2)
for _call in ROUND_CALLS_0_1:
    ENGINE_0_2 = ENGINE_0_2.replace(_call, "")

LEGACY = "b64legacy"  # registry name, package and (wtcore-b64legacy 0.1.0) distribution
UPGRADED = "b64upgraded"  # the same engine with the change applied (wtcore-b64upgraded 0.2.0)


def _expected_refusal(origin: str) -> str:
    """The whole message for the 0.1 trainer engine; ``origin``: ``"dist version, "`` or ``""``."""
    return (
        f"trainer engine {LEGACY!r} ({origin}{LEGACY}:B64TrainerEngine) does not implement "
        f"worker_init_info() (or override handshake()), which wtcore {wtcore.__version__} "
        "requires of every trainer engine; it was probably written for an older wtcore. What "
        'to change: see CHANGELOG.md, 0.2.0, "For plugin authors"'
    )


#: The record 0.2 registers (``<name>:ENGINE`` in ``wtcore.backends``), naming both halves;
#: every package below has it, only a 0.2 declaration points at it.
RECORD_0_2 = """
from wtcore.registry import Halves

ENGINE = Halves(trainer="{name}:B64TrainerEngine", worker="{name}:B64WorkerEngine")
"""


#: How each release declares the engine: 0.2 one record, 0.1 a class in each of two groups.
DECLARED = {
    "0.2": "[wtcore.backends]\n{name} = {name}:ENGINE\n\n",
    "0.1": "[wtcore.engines]\n{name} = {name}:B64WorkerEngine\n\n"
    "[wtcore.trainer_engines]\n{name} = {name}:B64TrainerEngine\n\n",
}


def _install(
    where: Path, name: str, version: str, source: str, declared: tuple[str, ...] = ("0.2",)
) -> None:
    """Distribution ``wtcore-<name>``: package ``<name>`` registering engine ``<name>`` as the
    ``declared`` releases do."""
    package = where / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text((source + RECORD_0_2).replace("{name}", name))
    info = where / f"wtcore_{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: wtcore-{name}\nVersion: {version}\n"
    )
    eps = "".join(DECLARED[release] for release in declared)
    (info / "entry_points.txt").write_text(eps.replace("{name}", name))


@contextmanager
def _installed(
    where: Path, name: str, version: str, source: str, declared: tuple[str, ...] = ("0.2",)
) -> Iterator[list[str]]:
    """The distribution installed on ``sys.path`` and seen by the registries, then gone; yields
    the warnings their discovery gave (0.1's declaration alone: one)."""
    _install(where, name, version, source, declared)
    sys.path.insert(0, str(where))
    importlib.invalidate_caches()
    ENGINES.refresh()
    TRAINER_ENGINES.refresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ENGINES.names()
        TRAINER_ENGINES.names()
    try:
        yield [str(w.message) for w in caught]
    finally:
        sys.path.remove(str(where))
        sys.modules.pop(name, None)
        importlib.invalidate_caches()
        ENGINES.refresh()
        TRAINER_ENGINES.refresh()


@pytest.fixture
def legacy(tmp_path: Path) -> Iterator[Path]:
    """wtcore-b64legacy 0.1.0 installed, declared in 0.1's groups; yields its folder."""
    with _installed(tmp_path / "site", LEGACY, "0.1.0", ENGINE_0_1, ("0.1",)) as warned:
        assert len(warned) == 1, warned
        yield tmp_path / "site"


def test_the_0_1_declaration_is_still_found_with_one_warning_naming_the_record(
    tmp_path: Path,
) -> None:
    with _installed(tmp_path, "b64old", "0.1.0", ENGINE_0_2, ("0.1",)) as warned:
        assert warned == [
            "wtcore-b64old 0.1.0 registers engine 'b64old' in 0.1.0's groups wtcore.engines "
            "and wtcore.trainer_engines, read until 0.3 only: declare it once, "
            '[project.entry-points."wtcore.backends"] b64old = "b64old:ENGINE", with ENGINE = '
            'wtcore.registry.Halves(trainer="b64old:B64TrainerEngine", '
            'worker="b64old:B64WorkerEngine") in b64old'
        ]
        assert ENGINES.load("b64old").__name__ == "B64WorkerEngine"
        assert TRAINER_ENGINES.load("b64old").__name__ == "B64TrainerEngine"
        assert TRAINER_ENGINES.info("b64old").target == "b64old:B64TrainerEngine"


def test_a_distribution_declaring_both_ways_is_read_as_0_2_without_a_warning(
    tmp_path: Path,
) -> None:
    """A plugin may keep 0.1's groups next to its record, to support both releases."""
    with _installed(tmp_path, "b64both", "0.2.0", ENGINE_0_2, ("0.2", "0.1")) as warned:
        assert warned == []
        assert TRAINER_ENGINES.info("b64both").target == "b64both:ENGINE"
        assert ENGINES.conflicts() == [] and TRAINER_ENGINES.conflicts() == []


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


# ---------------------------------------------------------------------- the 0.1 engine
def test_the_0_1_trainer_engine_is_refused_when_first_loaded_by_name(legacy: Path) -> None:
    assert LEGACY in TRAINER_ENGINES.names() and LEGACY in ENGINES.names()
    assert LEGACY not in sys.modules  # listing imports nothing; loading is what checks
    with pytest.raises(PluginLoadError) as exc:
        TRAINER_ENGINES.load(LEGACY)
    assert str(exc.value) == _expected_refusal("wtcore-b64legacy 0.1.0, ")
    # one of the family, caught by what catches any plugin that cannot be used
    assert exc.value.reason == "api" and isinstance(exc.value, ImportError)
    # refused on every load, never cached as good
    with pytest.raises(PluginLoadError, match="does not implement"):
        TRAINER_ENGINES.load(LEGACY)


def test_the_factory_and_config_refuse_it_before_any_call_reaches_a_receiver(
    legacy: Path, tmp_path: Path
) -> None:
    state = mixed_dtype_state(seed=21)
    worker = WeightSyncWorker(LEGACY, ModuleSink(build_module(zeros_like_state(state))))
    client = RecordingClient(InProcessClient(worker, timeout_s=30))
    try:
        info = _module(LEGACY).B64TrainerInitInfo(rank=0, buffer_size_bytes=256)
        with pytest.raises(PluginLoadError) as exc:
            WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=TensorSource(state)
            )
        assert str(exc.value) == _expected_refusal("wtcore-b64legacy 0.1.0, ")
        config = tmp_path / "trainer.toml"
        config.write_text(f'backend = "{LEGACY}"\nbuffer_size_bytes = 256\n')
        with pytest.raises(PluginLoadError) as exc:
            trainer_from_config(config, client=client, source=TensorSource(state))
        assert str(exc.value) == _expected_refusal("wtcore-b64legacy 0.1.0, ")
        assert client.names() == []  # refused up front: no init, no round, nothing to recover
        assert worker.weight_info()["state"] == "uninitialized"
    finally:
        worker.shutdown()


def test_explicit_registration_refuses_the_class_and_registers_nothing(legacy: Path) -> None:
    legacy_cls = _module(LEGACY).B64TrainerEngine
    with pytest.raises(PluginLoadError) as exc:
        TRAINER_ENGINES.register("b64legacy-runtime", legacy_cls)
    assert str(exc.value) == _expected_refusal("").replace(f"{LEGACY!r}", "'b64legacy-runtime'", 1)
    assert "b64legacy-runtime" not in TRAINER_ENGINES.names()
    # an import target is not imported at registration: it is refused when first loaded
    TRAINER_ENGINES.register("b64legacy-target", f"{LEGACY}:B64TrainerEngine")
    try:
        with pytest.raises(PluginLoadError, match=r"'b64legacy-target' \(b64legacy:B64Trainer"):
            TRAINER_ENGINES.load("b64legacy-target")
    finally:
        TRAINER_ENGINES.unregister("b64legacy-target")


def test_the_0_1_worker_engine_is_still_accepted(legacy: Path) -> None:
    # The worker half has no new required method (abort() is optional): it loads and joins.
    assert ENGINES.load(LEGACY).__name__ == "B64WorkerEngine"
    state = mixed_dtype_state(seed=22)
    worker = WeightSyncWorker(LEGACY, ModuleSink(build_module(zeros_like_state(state))))
    try:
        worker.init_weight_transfer_engine({"buffer_size_bytes": 1 << 20})
        assert worker.weight_info()["state"] == "idle"
    finally:
        worker.shutdown()


def test_wtcore_plugins_lists_the_0_1_trainer_engine_as_broken(
    legacy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wtcore.cli import main

    assert main(["plugins"]) == 1
    out, err = capsys.readouterr()
    assert err.strip() == "wtcore plugins: some plugins are broken or conflicting"
    trainer_section = out.split("trainer engines (wtcore.backends):\n", 1)[1]
    (line,) = [x for x in trainer_section.splitlines() if x.startswith(f"  {LEGACY} ")]
    assert re.fullmatch(
        rf"  {LEGACY} +wtcore-b64legacy 0\.1\.0 +BROKEN: "
        + re.escape(_expected_refusal("wtcore-b64legacy 0.1.0, ")),
        line,
    ), line

    assert main(["plugins", "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    by_title = {r["title"]: {p["name"]: p for p in r["plugins"]} for r in record["registries"]}
    trainer = by_title["trainer engines"][LEGACY]
    assert (trainer["ok"], trainer["status"]) == (
        False,
        "BROKEN: " + _expected_refusal("wtcore-b64legacy 0.1.0, "),
    )
    worker = by_title["engines"][LEGACY]
    assert (worker["ok"], worker["status"]) == (True, "available")
    assert all(p["ok"] for p in by_title["engines"].values())


def test_the_refusal_points_at_notes_that_exist() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    release = text.split("\n## 0.2.0", 1)[1].split("\n## ", 1)[0]
    assert "\n### For plugin authors\n" in release
    notes = release.split("\n### For plugin authors\n", 1)[1].split("\n### ", 1)[0]
    assert "worker_init_info" in notes and "handshake" in notes
    assert WORKER_INIT_INFO_0_2.strip().splitlines()[0].strip() in notes  # the code to write


# ---------------------------------------------------------------------- what is checked
class _NoReceive(WeightTransferEngine[Any, Any]):
    init_info_cls = dict
    update_info_cls = dict

    def init_transfer_engine(self, init_info: Any) -> None:
        pass


class _NothingAtAll(TrainerWeightTransferEngine):
    pass


class _JoinsInHandshake(TrainerWeightTransferEngine):
    """No worker_init_info(): it initializes receivers in its own handshake(), as nccl does."""

    def handshake(self) -> None:
        assert self.client is not None
        self.client.init_weight_transfer_engine({})

    def _send(self, source: Any, stats: TransferStats) -> None:
        pass


def test_every_missing_method_is_named() -> None:
    with pytest.raises(PluginLoadError) as exc:
        ENGINES.register("no-receive", _NoReceive)
    assert f"engine 'no-receive' ({__name__}:_NoReceive) does not implement receive_weights()" in (
        str(exc.value)
    )
    assert "no-receive" not in ENGINES.names()
    with pytest.raises(PluginLoadError) as exc:
        TRAINER_ENGINES.register("nothing", _NothingAtAll)
    assert (
        "does not implement _send() and worker_init_info() (or override handshake()), which "
        f"wtcore {wtcore.__version__} requires of every trainer engine"
    ) in str(exc.value)
    assert 'see CHANGELOG.md, 0.2.0, "For plugin authors"' in str(exc.value)


def test_an_engine_that_overrides_handshake_needs_no_worker_init_info() -> None:
    TRAINER_ENGINES.register("joins-in-handshake", _JoinsInHandshake)
    try:
        assert TRAINER_ENGINES.load("joins-in-handshake") is _JoinsInHandshake
    finally:
        TRAINER_ENGINES.unregister("joins-in-handshake")


def test_built_in_and_first_party_engines_pass_the_check() -> None:
    from importlib.metadata import distributions

    installed = {d.metadata["Name"] for d in distributions()}
    first_party = {n for n, d in (("nccl", "wtcore-nccl"), ("ipc", "wtcore-ipc")) if d in installed}
    for registry, base in (
        (ENGINES, WeightTransferEngine),
        (TRAINER_ENGINES, TrainerWeightTransferEngine),
    ):
        assert {"inline", *first_party} <= set(registry.names())
        for name in sorted({"inline", *first_party}):
            cls = registry.load(name)  # raises PluginLoadError if anything were missing
            assert issubclass(cls, base) and not getattr(cls, "__abstractmethods__", None)


# ---------------------------------------------------------------------- after the upgrade
class TestUpgradedEngineContract(EngineContractSuite):
    """The 0.1 engine with the CHANGELOG's changes applied: every case, recovery included."""

    backend = UPGRADED

    @pytest.fixture(autouse=True)
    def _upgraded(self, tmp_path: Path) -> Iterator[None]:
        with _installed(tmp_path / "site", UPGRADED, "0.2.0", ENGINE_0_2):
            yield

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> TrainerInitInfo:
        info: TrainerInitInfo = _module(UPGRADED).B64TrainerInitInfo(
            rank=0, buffer_size_bytes=buffer_size_bytes
        )
        return info

    def test_it_is_accepted_and_completes_a_verified_round(self) -> None:
        assert TRAINER_ENGINES.info(UPGRADED).origin == "wtcore-b64upgraded 0.2.0"
        state = mixed_dtype_state(seed=23)
        modules = [build_module(zeros_like_state(state)) for _ in range(2)]
        workers = [
            WeightSyncWorker(UPGRADED, ModuleSink(m), rank=i, world_size=2)
            for i, m in enumerate(modules)
        ]
        info = self.make_trainer_init_info(num_workers=2, buffer_size_bytes=256)
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=InProcessClient(workers, timeout_s=30), source=TensorSource(state)
        )
        try:
            # receivers' checksums compared with what was sent before the round is finished
            stats = trainer.send_weights(weight_version="v1", verify=True)
            assert stats.num_buckets > 1
            for m, w in zip(modules, workers, strict=True):
                assert_state_equal(m, state)
                assert w.weight_info()["weight_version"] == "v1"
        finally:
            trainer.shutdown()
            for w in workers:
                w.shutdown()
