"""Run the bench: receivers up, limits measured, rounds sent and verified, receivers down."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from wtcore.bench.fleet import ModelSpec, launch_fleet
from wtcore.bench.memory import PeakTracker

__all__ = ["BenchOptions", "run_bench"]


@dataclass
class BenchOptions:
    backend: str = "local"
    client: str = "inproc"
    receivers: int = 2
    size_bytes: int = 64 << 20
    num_tensors: int = 100
    dtype: str = "bfloat16"
    rounds: int = 3
    buffer_sizes: list[int] = field(default_factory=list)  # empty: the engine's default
    baselines: str = "auto"  # auto | all | none
    transactional: bool = False
    torch_threads: int = 1  # 0: leave torch's default
    timeout_s: float = 300.0
    corrupt_round: int | None = None  # testing only: corrupt receiver 0 after this round


def _trainer_config(backend: str, receivers: int, buffer_size: int | None) -> dict[str, Any]:
    """A config for ``backend`` filled in from the names of its init-info fields."""
    from wtcore.registry import TRAINER_ENGINES
    from wtcore.testing.net import free_port

    info_cls = TRAINER_ENGINES.load(backend).init_info_cls
    fields = {f.name for f in dataclasses.fields(info_cls)}
    cfg: dict[str, Any] = {"backend": backend}
    if "master_address" in fields:
        cfg["master_address"] = "127.0.0.1"
    if "master_port" in fields:
        cfg["master_port"] = free_port()
    if "world_size" in fields:
        cfg["world_size"] = receivers + 1
    if buffer_size is not None:
        key = next(
            (k for k in ("packed_buffer_size_bytes", "buffer_size_bytes") if k in fields), None
        )
        if key is None:
            raise ValueError(f"backend {backend!r} has no buffer size setting")
        cfg[key] = buffer_size
    return cfg


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # the bar is optional: pip install wtcore[bench]
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="round", leave=False)


def _limits(opts: BenchOptions, state: Mapping[str, Any], nbytes: int) -> dict[str, float]:
    from wtcore.bench import limits

    want = opts.baselines
    if want == "none":
        return {}
    out = {"memcpy": limits.memcpy_gbps(nbytes), "file": limits.file_gbps(state)}
    if want == "all" or opts.backend == "nccl":
        out["raw_gloo"] = limits.raw_gloo_gbps(nbytes, opts.receivers)
        out["per_tensor"] = limits.per_tensor_gbps(state, opts.receivers)
    if want == "all" or opts.backend == "ipc":
        out["shm_copy"] = limits.shm_copy_gbps(nbytes)
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in (
        "wtcore",
        "torch",
        "wtcore-nccl",
        "wtcore-ipc",
        "wtcore-http-client",
        "wtcore-ray-client",
        "ray",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def _run_engine(
    opts: BenchOptions, spec: ModelSpec, model: Any, buffer_size: int | None, bar: Any
) -> dict[str, Any]:
    """One engine configuration: fresh receivers, ``rounds`` verified rounds."""
    import torch

    from wtcore.config import trainer_from_config
    from wtcore.digest import digest_named
    from wtcore.source import ModuleSource

    fleet = launch_fleet(
        opts.client,
        opts.backend,
        opts.receivers,
        spec,
        timeout_s=opts.timeout_s,
        transactional=opts.transactional,
    )
    rounds: list[dict[str, Any]] = []
    try:
        engine = trainer_from_config(
            _trainer_config(opts.backend, opts.receivers, buffer_size),
            source=ModuleSource(model),
            client=fleet.client,
        )
        try:
            tracker = PeakTracker([os.getpid(), *(p for p in fleet.pids() if p != os.getpid())])
            for r in range(opts.rounds):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1)
                tracker.start()
                stats = engine.send_weights(weight_version=f"bench-{r}")
                mem = tracker.extra_mib()
                if opts.corrupt_round == r:
                    _corrupt(fleet)
                want = digest_named(model.named_parameters())
                got = fleet.client.checksums()
                per = [got] if isinstance(got, Mapping) else list(got)
                bad = [sum(d.get(n) != v for n, v in want.items()) for d in per]
                infos = fleet.client.weight_info()
                infos = [infos] if isinstance(infos, Mapping) else list(infos)
                versions = [i.get("weight_version") for i in infos]
                rounds.append(
                    {
                        **{
                            k: stats.to_dict()[k]
                            for k in ("seconds", "gbps", "num_bytes", "num_tensors", "num_buckets")
                        },
                        "phases": dict(stats.phase_seconds),
                        "trainer_extra_mib": mem[0],
                        "receivers_extra_mib": mem[1:] if len(mem) > 1 else mem[:1],
                        "verified": all(b == 0 for b in bad)
                        and len(per) == opts.receivers
                        and versions == [f"bench-{r}"] * opts.receivers,
                        "mismatched_tensors": bad,
                        "receiver_versions": versions,
                    }
                )
                if bar is not None:
                    bar.update(1)
        finally:
            engine.shutdown()
    finally:
        fleet.close()
    gbps = [r["gbps"] for r in rounds]
    return {
        "buffer_size": buffer_size,
        "rounds": rounds,
        "median_seconds": statistics.median(r["seconds"] for r in rounds),
        "median_gbps": statistics.median(gbps),
        "verified": all(r["verified"] for r in rounds),
    }


def _corrupt(fleet: Any) -> None:
    """Testing only: flip one value on receiver 0 (in-process receivers)."""
    import torch

    workers = getattr(fleet, "workers", None)
    if not workers:
        raise ValueError("corrupt_round works only with --client inproc")
    param = next(workers[0].sink.module.parameters())
    with torch.no_grad():
        param.view(-1)[:1].add_(1)


def run_bench(opts: BenchOptions, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run everything; returns the JSON-ready record (``record["ok"]`` says if all verified)."""
    from wtcore.testing.sources import build_module

    spec = ModelSpec(opts.size_bytes, opts.num_tensors, opts.dtype, seed=0)
    state = spec.build_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    limits = _limits(opts, state, nbytes)
    model = build_module(state)
    del state
    configs: list[int | None] = list(opts.buffer_sizes) or [None]
    if opts.torch_threads > 0:
        import torch

        torch.set_num_threads(opts.torch_threads)
    bar = _progress(opts.rounds * len(configs), f"wtcore bench {opts.backend}/{opts.client}")
    try:
        runs = [_run_engine(opts, spec, model, b, bar) for b in configs]
    finally:
        if bar is not None:
            bar.close()
    best = max(r["median_gbps"] for r in runs)
    ratios = {name: best / gbps for name, gbps in limits.items() if gbps > 0}
    return {
        "ok": all(r["verified"] for r in runs),
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": _versions(),
        "settings": {
            **dataclasses.asdict(opts),
            "model_bytes": nbytes,
            "model_tensors": sum(1 for _ in model.parameters()),
        },
        "limits_gbps": limits,
        "runs": runs,
        "best_median_gbps": best,
        "ratios": ratios,
    }
