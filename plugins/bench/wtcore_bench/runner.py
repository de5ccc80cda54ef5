"""Run the bench: receivers up, baselines measured, rounds sent and verified, receivers down."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from wtcore.errors import PayloadError
from wtcore_bench.api import (
    BaselineContext,
    BenchNotSupportedError,
    EngineBench,
    ModelSpec,
    device_kind,
)
from wtcore_bench.baselines import measure_baselines, select_baselines
from wtcore_bench.fleet import launch_fleet
from wtcore_bench.memory import PeakTracker
from wtcore_bench.record import with_deprecated_keys
from wtcore_bench.support import engine_bench
from wtcore_bench.turns import Turns

if TYPE_CHECKING:
    from wtcore.trainer import TrainerWeightTransferEngine

__all__ = ["BenchOptions", "run_bench"]


@dataclass
class BenchOptions:
    backend: str = "inline"
    client: str = "inproc"
    receivers: int = 2
    size_bytes: int = 64 << 20
    num_tensors: int = 100
    dtype: str = "bfloat16"
    rounds: int = 3
    buffer_sizes: list[int] = field(default_factory=list)  # empty: the engine's default
    baselines: str = "auto"  # auto, peers, all or none (wtcore_bench.baselines)
    device: str = "cpu"  # where sources, staging and sinks live: "cpu" or "cuda[:N]"
    transactional: bool = False
    #: A staged fleet and a classic one, their rounds in turns (``--staged``).
    staged: bool = False
    torch_threads: int = 1  # 0: leave torch's default
    timeout_s: float = 300.0
    host: str = "127.0.0.1"  # where rendezvous points and receivers listen
    corrupt_round: int | None = None  # testing only: corrupt receiver 0 after this round
    #: Extra fields of the engine's init info (``--engine-option topology=chain``).
    engine_options: dict[str, Any] = field(default_factory=dict)
    #: Measure the baselines that have a session in turns with the rounds (``--interleave``).
    interleave: bool = False


def _check_device(device: str) -> None:
    kind = device_kind(device)
    if kind not in ("cpu", "cuda") or (kind == "cpu" and device != "cpu"):
        raise PayloadError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BenchNotSupportedError(
                f"--device {device}: this torch ({torch.__version__}) sees no CUDA device "
                "(torch.cuda.is_available() is False)"
            )


def _versions(opts: BenchOptions) -> dict[str, str]:
    from importlib.metadata import version

    from wtcore._version import __version__
    from wtcore.registry import CLIENTS, TRAINER_ENGINES

    out = {"python": platform.python_version(), "wtcore": __version__, "torch": version("torch")}
    for info in (TRAINER_ENGINES.info(opts.backend), CLIENTS.info(opts.client)):
        if info.distribution is not None:
            out[info.distribution] = info.version or "?"
    return out


def _run_engine(
    opts: BenchOptions,
    engine_cls: type[TrainerWeightTransferEngine],
    support: EngineBench,
    spec: ModelSpec,
    model: Any,
    buffer_size: int | None,
    bar: Any,
    turns: Turns,
) -> list[dict[str, Any]]:
    """One engine configuration: fresh receivers and ``rounds`` verified rounds, each after
    one timed call of every baseline in ``turns`` (``staged``: two fleets, in turns)."""
    kinds: list[bool | None] = [True, False] if opts.staged else [None]
    with contextlib.ExitStack() as stack:
        sessions = [
            stack.enter_context(_session(opts, engine_cls, support, spec, model, buffer_size, k))
            for k in kinds
        ]
        rounds: list[list[dict[str, Any]]] = [[] for _ in kinds]
        for r in range(opts.rounds):
            for one_round, done in zip(sessions, rounds, strict=True):
                done.append(one_round(r, turns.run_each()))
            bar.update(1)
    return [
        {
            "buffer_size": buffer_size,
            **({} if k is None else {"round_kind": "staged" if k else "classic"}),
            "rounds": done,
            "median_seconds": statistics.median(r["seconds"] for r in done),
            "median_gbps": statistics.median(r["gbps"] for r in done),
            "verified": all(r["verified"] for r in done),
        }
        for k, done in zip(kinds, rounds, strict=True)
    ]


@contextlib.contextmanager
def _session(
    opts: BenchOptions,
    engine_cls: type[TrainerWeightTransferEngine],
    support: EngineBench,
    spec: ModelSpec,
    model: Any,
    buffer_size: int | None,
    staged: bool | None,
) -> Iterator[Callable[[int, dict[str, float]], dict[str, Any]]]:
    """A fleet and a trainer engine; yields ``one_round(r, baseline_seconds)``."""
    import torch

    from wtcore.digest import digest_named
    from wtcore.source import ModuleSource

    on_device = {} if opts.device == "cpu" else {"device": opts.device}
    prepare = {k: v for k, v in opts.engine_options.items() if k in support.model_options}
    fields = {k: v for k, v in opts.engine_options.items() if k not in prepare}
    if staged is not None:
        fields["staged"] = staged
    info = support.init_info(
        engine_cls,
        receivers=opts.receivers,
        host=opts.host,
        buffer_size_bytes=buffer_size,
        **on_device,
    )
    if fields:
        try:  # a new dataclass instance: its own checks run again
            info = dataclasses.replace(info, **fields)
        except TypeError as e:
            raise PayloadError(
                f"--engine-option: {engine_cls.init_info_cls.__name__} has no field "
                f"{sorted(fields)} ({e})"
            ) from None
    fleet = launch_fleet(
        opts.client,
        opts.backend,
        opts.receivers,
        spec,
        timeout_s=opts.timeout_s,
        options={"transactional": bool(staged) or opts.transactional},
    )
    with contextlib.ExitStack() as stack:  # on exit: the engine, the model options, the fleet
        stack.callback(fleet.close)
        for name, value in prepare.items():
            stack.enter_context(support.model_options[name](model, value))
        engine = engine_cls.trainer_init(info, source=ModuleSource(model), client=fleet.client)
        stack.callback(engine.shutdown)
        tracker = PeakTracker([os.getpid(), *(p for p in fleet.pids() if p != os.getpid())])

        def one_round(r: int, baseline_seconds: dict[str, float]) -> dict[str, Any]:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            tracker.start()
            stats = engine.send_weights(weight_version=f"bench-{r}")
            mem = tracker.extra_mib()
            if opts.corrupt_round == r:
                _corrupt(fleet)
            want = digest_named(model.named_parameters())
            per = fleet.client.checksums()
            bad = [sum(d.get(n) != v for n, v in want.items()) for d in per]
            versions = [i.get("weight_version") for i in fleet.client.weight_info()]
            keys = ("seconds", "gbps", "num_bytes", "num_tensors", "num_buckets")
            paused = [t.get("paused_s") for t in stats.receiver_times or []]
            return {
                **{k: v for k, v in stats.to_dict().items() if k in keys},
                "phases": dict(stats.phase_seconds),
                "trainer_extra_mib": mem[0],
                "receivers_extra_mib": mem[1:] if len(mem) > 1 else mem[:1],
                "verified": not any(bad)
                and len(per) == opts.receivers
                and versions == [f"bench-{r}"] * opts.receivers,
                "mismatched_tensors": bad,
                "receiver_versions": versions,
                "baseline_seconds": baseline_seconds,
                # each receiver's time not serving a published version, and its share of the round
                "receiver_times": stats.receiver_times,
                "paused_s": paused,
                "paused_ratio": [None if p is None else p / stats.seconds for p in paused],
            }

        yield one_round


def _corrupt(fleet: Any) -> None:
    """Testing only: flip one value on receiver 0 (in-process receivers)."""
    import torch

    workers = getattr(fleet, "workers", None)
    if not workers:
        raise BenchNotSupportedError("corrupt_round works only with in-process receivers")
    param = next(workers[0].sink.module.parameters())
    with torch.no_grad():
        param.view(-1)[:1].add_(1)


def run_bench(opts: BenchOptions, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run everything; returns the record (:mod:`wtcore_bench.record`)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    from wtcore.registry import TRAINER_ENGINES
    from wtcore_bench.nodes import placement
    from wtcore_kit.synthetic import build_module

    _check_device(opts.device)
    where = placement()  # inside the trainer's node of `wtcore bench --nodes`
    if where is not None:
        opts = dataclasses.replace(opts, host=where.trainer_address)
    # a renamed engine's old name warns once, here; the run and its record use the new one
    opts = dataclasses.replace(opts, backend=TRAINER_ENGINES.resolve(opts.backend))
    engine_cls = TRAINER_ENGINES.load(opts.backend)
    support = engine_bench(opts.backend, engine_cls)  # before anything starts: a clear error
    support.check_device(engine_cls, opts.device)
    if opts.buffer_sizes:
        support.buffer_kwargs(engine_cls, opts.buffer_sizes[0])
    baselines, skipped = select_baselines(opts.baselines, opts.device, support)
    spec = ModelSpec(opts.size_bytes, opts.num_tensors, opts.dtype, seed=0, device=opts.device)
    state = spec.build_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ctx = BaselineContext(
        state, nbytes, opts.receivers, opts.host, opts.timeout_s, device=opts.device
    )
    in_turns = {n: b for n, b in baselines.items() if opts.interleave and b.session is not None}
    measured = measure_baselines(
        {n: b for n, b in baselines.items() if n not in in_turns}, ctx, skipped
    )
    configs: list[int | None] = list(opts.buffer_sizes) or [None]
    with Turns.open(in_turns, ctx, skipped) as turns:
        del ctx
        model = build_module(state).to(opts.device)
        del state
        if opts.torch_threads > 0:
            import torch

            torch.set_num_threads(opts.torch_threads)
        desc = f"wtcore bench {opts.backend}/{opts.client}"
        total = opts.rounds * len(configs)
        with tqdm(total=total, desc=desc, file=sys.stderr, unit="round", leave=False) as bar:
            runs = [
                run
                for b in configs
                for run in _run_engine(opts, engine_cls, support, spec, model, b, bar, turns)
            ]
    measured.update(turns.gbps(nbytes))
    measured = {n: measured[n] for n in baselines if n in measured}  # the declared order
    best = max(r["median_gbps"] for r in runs)
    ratios = {name: best / gbps for name, gbps in measured.items() if gbps > 0}
    record = {
        "ok": all(r["verified"] for r in runs),
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": _versions(opts),
        "settings": {
            **dataclasses.asdict(opts),
            "buffer_option": support.buffer_option,
            "model_bytes": nbytes,
            "model_tensors": sum(1 for _ in model.parameters()),
        },
        "baselines_gbps": measured,
        "baseline_labels": {name: b.label for name, b in baselines.items() if name in measured},
        "peers": [name for name, b in baselines.items() if b.peer and name in measured],
        "interleaved": list(turns.seconds),
        "skipped_baselines": skipped,
        "runs": runs,
        "best_median_gbps": best,
        "ratios": ratios,
    }
    return with_deprecated_keys(record)
