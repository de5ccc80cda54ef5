"""``wtcore bench`` through the engine and client APIs alone, with a third-party engine.

The engine below is defined here and registered at runtime, its bench support with it
(:func:`wtcore_bench.support.register_engine_bench`, what an ``engine.<name>`` entry point in
``wtcore.bench`` does for an installed plugin); nothing about it follows the
first-party engines' naming (its buffer option is ``chunk_bytes``, it has a "rendezvous port"
only its own :class:`EngineBench` knows how to choose). If the bench runs it, verifies every
round and measures its own baseline, the core needed nothing but the declared API.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch

from wtcore.engine import WeightTransferEngine
from wtcore.errors import PayloadError, WtcoreError
from wtcore.meta import dtype_from_name, dtype_name
from wtcore.registry import CLIENTS, ENGINES, TRAINER_ENGINES
from wtcore.source import WeightSource, iter_checked
from wtcore.stats import TransferStats
from wtcore.testing.net import free_port
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine
from wtcore_bench import (
    Baseline,
    BaselineContext,
    BenchNotSupportedError,
    BenchOptions,
    ClientBench,
    EngineBench,
    OptionalDependencyError,
    run_bench,
)
from wtcore_bench.report import check_plot_available, print_table
from wtcore_bench.support import register_client_bench, register_engine_bench

NAME = "thirdparty-b64"
BASELINE_CALLS: list[BaselineContext] = []


@dataclass
class B64TrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = NAME
    rendezvous_port: int = 0
    chunk_bytes: int = 1 << 20


@dataclass
class B64InitInfo:
    rendezvous_port: int
    chunk_bytes: int


@dataclass
class B64UpdateInfo:
    name: str
    dtype: str
    shape: list[int]
    data: str


class B64WorkerEngine(WeightTransferEngine[B64InitInfo, B64UpdateInfo]):
    init_info_cls = B64InitInfo
    update_info_cls = B64UpdateInfo

    def init_transfer_engine(self, init_info: B64InitInfo) -> None:
        if not 0 < init_info.rendezvous_port < 65536:
            raise PayloadError(f"rendezvous_port: got {init_info.rendezvous_port}")
        self.chunk_bytes = init_info.chunk_bytes

    def receive_weights(self, update_info: B64UpdateInfo) -> None:
        raw = bytearray(base64.b64decode(update_info.data))
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        dt = dtype_from_name(update_info.dtype)
        self.sink.load_weights([(update_info.name, t.view(dt).reshape(update_info.shape))])


def _one_byte_per_call(ctx: BaselineContext) -> float:
    BASELINE_CALLS.append(ctx)
    return 0.5


class B64Bench(EngineBench):
    def init_info(
        self,
        engine: type[TrainerWeightTransferEngine],
        *,
        receivers: int,
        host: str,
        buffer_size_bytes: int | None,
    ) -> TrainerInitInfo:
        return engine.init_info_cls(
            rank=0,
            rendezvous_port=free_port(host),
            **self.buffer_kwargs(engine, buffer_size_bytes),
        )


class B64TrainerEngine(TrainerWeightTransferEngine):
    """One tensor per ``update_weights`` call, base64 in the payload."""

    init_info_cls = B64TrainerInitInfo

    def worker_init_info(self) -> dict[str, Any]:
        info = self.init_info
        assert isinstance(info, B64TrainerInitInfo)
        return {"rendezvous_port": info.rendezvous_port, "chunk_bytes": info.chunk_bytes}

    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        assert self.client is not None
        for meta, t in iter_checked(source):
            data = base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            self.client.update_weights(
                {
                    "name": meta.name,
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "data": data.decode("ascii"),
                }
            )
            stats.num_tensors += 1
            stats.num_bytes += meta.nbytes
            stats.num_buckets += 1


B64_BENCH = B64Bench(
    buffer_option="chunk_bytes",
    baselines={"one_byte": Baseline("one byte per call (made up)", _one_byte_per_call)},
)


@dataclass
class NeedsAddressInitInfo(B64TrainerInitInfo):
    backend: ClassVar[str] = "thirdparty-nobench"
    address: str = field(kw_only=True)  # no default: nothing the bench could guess


class NoBenchTrainerEngine(B64TrainerEngine):
    init_info_cls = NeedsAddressInitInfo


@pytest.fixture
def third_party() -> Iterator[None]:
    ENGINES.register(NAME, B64WorkerEngine)
    TRAINER_ENGINES.register(NAME, B64TrainerEngine)
    register_engine_bench(NAME, B64_BENCH)
    TRAINER_ENGINES.register("thirdparty-nobench", NoBenchTrainerEngine)
    BASELINE_CALLS.clear()
    try:
        yield
    finally:
        ENGINES.unregister(NAME)
        TRAINER_ENGINES.unregister(NAME)
        register_engine_bench(NAME, None)
        TRAINER_ENGINES.unregister("thirdparty-nobench")


def _opts(**kw: Any) -> BenchOptions:
    base: dict[str, Any] = dict(
        backend=NAME,
        receivers=2,
        size_bytes=64 << 10,
        num_tensors=12,
        dtype="float32",
        rounds=2,
        torch_threads=0,
        timeout_s=60.0,
    )
    return BenchOptions(**{**base, **kw})


@pytest.mark.timeout(120)
def test_third_party_engine_runs_in_the_bench_through_the_api_alone(third_party: None) -> None:
    record = run_bench(_opts(buffer_sizes=[4096, 8192]))
    assert record["ok"] is True
    assert [r["buffer_size"] for r in record["runs"]] == [4096, 8192]
    for run in record["runs"]:
        for i, r in enumerate(run["rounds"]):
            assert r["verified"] is True and r["mismatched_tensors"] == [0, 0]
            assert r["receiver_versions"] == [f"bench-{i}"] * 2
            assert r["num_buckets"] == record["settings"]["model_tensors"]
    assert record["settings"]["buffer_option"] == "chunk_bytes"
    # the engine's own baseline, next to the generic ones, measured once with the run's context
    assert set(record["baselines_gbps"]) == {"memcpy", "file", "one_byte"}
    assert record["baselines_gbps"]["one_byte"] == 0.5
    assert record["baseline_labels"]["one_byte"] == "one byte per call (made up)"
    assert len(BASELINE_CALLS) == 1 and BASELINE_CALLS[0].receivers == 2
    assert BASELINE_CALLS[0].nbytes == record["settings"]["model_bytes"]
    # versions: the providers of the chosen engine and client (here: runtime and the core)
    assert set(record["versions"]) == {"python", "wtcore", "torch"}
    out = io.StringIO()
    print_table(record, out)
    assert "one byte per call (made up)" in out.getvalue()


def test_an_undeclared_engine_needing_a_setting_the_bench_cannot_guess_names_it(
    third_party: None,
) -> None:
    """Without bench support an engine runs with the default (rank 0 and its init info's own
    defaults: tests/bench/test_bench_any_engine.py); a field without a default is named."""
    with pytest.raises(BenchNotSupportedError, match="cannot guess address of its Needs") as info:
        run_bench(_opts(backend="thirdparty-nobench", baselines="none"))
    assert isinstance(info.value, WtcoreError) and isinstance(info.value, NotImplementedError)
    assert "'thirdparty-nobench' declares no bench support" in str(info.value)
    assert "'engine.thirdparty-nobench' in the 'wtcore.bench' entry-point group" in str(info.value)


class LegacyBenchTrainerEngine(B64TrainerEngine):
    """Declares its bench support the pre-0.2 way, as a class attribute."""

    bench = B64_BENCH


def test_a_bench_class_attribute_still_works_with_a_deprecation_warning(
    third_party: None,
) -> None:
    ENGINES.register("thirdparty-legacy", B64WorkerEngine)
    TRAINER_ENGINES.register("thirdparty-legacy", LegacyBenchTrainerEngine)
    try:
        with pytest.warns(DeprecationWarning, match=r"LegacyBenchTrainerEngine\.bench is dep"):
            record = run_bench(_opts(backend="thirdparty-legacy", baselines="none", rounds=1))
    finally:
        ENGINES.unregister("thirdparty-legacy")
        TRAINER_ENGINES.unregister("thirdparty-legacy")
    assert record["ok"] is True and record["settings"]["buffer_option"] == "chunk_bytes"


def test_buffer_size_for_an_engine_without_a_buffer_option_is_refused_up_front(
    third_party: None,
) -> None:
    register_engine_bench(NAME, EngineBench())  # the default: no buffer option, no baselines
    with pytest.raises(BenchNotSupportedError, match="has no buffer size option"):
        run_bench(_opts(buffer_sizes=[4096], baselines="none"))


class _NoLauncherClient:
    """A registered client that declares no bench support."""

    def __init__(self, *a: Any, **kw: Any) -> None: ...
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def test_client_without_a_launcher_is_a_clear_error() -> None:
    CLIENTS.register("thirdparty-nolaunch", _NoLauncherClient)
    try:
        with pytest.raises(BenchNotSupportedError, match="cannot start receivers"):
            run_bench(BenchOptions(client="thirdparty-nolaunch", baselines="none", size_bytes=4096))
    finally:
        CLIENTS.unregister("thirdparty-nolaunch")


class _FourCallsOnly(_NoLauncherClient):
    """Launches real in-process receivers, but offers only the four vLLM calls."""


def test_a_fleet_client_without_inspection_is_refused_once_and_its_receivers_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wtcore.errors import PayloadError
    from wtcore_bench.fleet import InProcessFleet

    closed: list[InProcessFleet] = []
    real_close = InProcessFleet.close

    def close(self: InProcessFleet) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(InProcessFleet, "close", close)
    CLIENTS.register("thirdparty-fourcalls", _FourCallsOnly)
    register_client_bench("thirdparty-fourcalls", ClientBench(InProcessFleet))
    try:
        with pytest.raises(PayloadError) as info:
            run_bench(
                BenchOptions(client="thirdparty-fourcalls", baselines="none", size_bytes=4096)
            )
    finally:
        CLIENTS.unregister("thirdparty-fourcalls")
        register_client_bench("thirdparty-fourcalls", None)
    message = str(info.value)
    assert "client 'thirdparty-fourcalls': the bench needs a wtcore.client.InspectableClient" in (
        message
    )
    assert message.endswith(
        "_FourCallsOnly, which lacks weight_info, checksums, abort_weight_update, "
        "get_world_size, close"
    )
    assert len(closed) == 1, "the receivers it started must be stopped"


def test_plot_without_matplotlib_is_one_wtcore_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *a: Any, **kw: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(OptionalDependencyError, match=r"pip install matplotlib") as info:
        check_plot_available()
    assert isinstance(info.value, WtcoreError) and isinstance(info.value, ImportError)


@pytest.mark.processes
def test_plot_without_matplotlib_from_the_cli_prints_one_line(tmp_path: Any) -> None:
    """A site dir that hides matplotlib; the CLI fails before the run, in one line."""
    import subprocess
    import sys

    shadow = tmp_path / "shadow"
    (shadow / "matplotlib").mkdir(parents=True)
    (shadow / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    proc = subprocess.run(
        [sys.executable, "-m", "wtcore.cli", "bench", "--plot", str(tmp_path / "p.png")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install matplotlib" in lines[0]
    assert proc.stdout == ""
