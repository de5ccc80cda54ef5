"""``wtcore bench --delta``: delta rounds against full rounds, on real training steps, then on
steps where every element changes (what delta costs when it cannot help). A full round before
and after each delta round (their mean) keeps the order fair; every round is verified.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from wtcore.errors import TransferError

if TYPE_CHECKING:
    import torch

    from wtcore.trainer import TrainerWeightTransferEngine
    from wtcore.worker import WeightSyncWorker

__all__ = ["DeltaBenchOptions", "print_delta_table", "run_delta_bench"]


@dataclass
class DeltaBenchOptions:
    backend: str = "inline"
    receivers: int = 2
    steps: int = 8  # real training steps
    dense_rounds: int = 12  # rounds where every element changes
    width: int = 256  # the transformer's d_model (4 layers, 8192-token vocabulary)
    lr: float = 1e-5
    timeout_s: float = 300.0
    host: str = "127.0.0.1"
    #: The delta trainer's ``delta``: ``"on"`` (``True``) or ``"auto"``.
    mode: str = "on"


def _fleet(
    backend: str, state: dict[str, torch.Tensor], n: int, timeout_s: float
) -> tuple[list[WeightSyncWorker], Any]:
    import torch

    from wtcore.sink import ModuleSink
    from wtcore.worker import WeightSyncWorker
    from wtcore_kit.inproc import InProcessClient
    from wtcore_kit.synthetic import build_module

    workers = [
        WeightSyncWorker(
            backend,
            ModuleSink(build_module({k: torch.zeros_like(v) for k, v in state.items()})),
            rank=i,
            world_size=n,
        )
        for i in range(n)
    ]
    return workers, InProcessClient(workers, timeout_s=timeout_s)


def _trainer(
    opts: DeltaBenchOptions, client: Any, delta: bool, source: Any
) -> TrainerWeightTransferEngine:
    from wtcore.registry import TRAINER_ENGINES
    from wtcore_bench.support import engine_bench

    cls = TRAINER_ENGINES.load(opts.backend)
    info = engine_bench(opts.backend, cls).init_info(
        cls, receivers=opts.receivers, host=opts.host, buffer_size_bytes=None
    )
    info.delta = ("auto" if opts.mode == "auto" else True) if delta else False
    engine: TrainerWeightTransferEngine = cls.trainer_init(info, client=client, source=source)
    return engine


def _dense(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from wtcore_delta.codec import bits

    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        b = bits(t)
        b.copy_(b ^ 1)
    return out


def run_delta_bench(opts: DeltaBenchOptions) -> dict[str, Any]:
    import importlib.util

    import torch

    if importlib.util.find_spec("wtcore_delta") is None:
        from wtcore_bench.api import OptionalDependencyError

        raise OptionalDependencyError(
            "wtcore bench --delta needs delta rounds: pip install wtcore-delta"
        )

    from wtcore.digest import digest_named
    from wtcore.registry import TRAINER_ENGINES
    from wtcore.source import TensorSource
    from wtcore.testing.realistic import changed_fraction, realistic_steps

    opts = dataclasses.replace(opts, backend=TRAINER_ENGINES.resolve(opts.backend))
    t0 = time.perf_counter()
    steps = realistic_steps(
        opts.steps, lr=opts.lr, d_model=opts.width, layers=4, vocab=8192, seq=64, batch=4
    )
    train_s = time.perf_counter() - t0
    states = list(steps)
    for _ in range(opts.dense_rounds):
        states.append(_dense(states[-1]))
    live = {n: t.clone() for n, t in states[0].items()}
    source = TensorSource(live)
    fleets = {k: _fleet(opts.backend, live, opts.receivers, opts.timeout_s) for k in ("d", "f")}
    trainers: dict[str, TrainerWeightTransferEngine] = {}
    rounds: list[dict[str, Any]] = []
    try:
        trainers = {k: _trainer(opts, fleets[k][1], k == "d", source) for k in ("d", "f")}
        for r, new in enumerate(states):
            prev = states[r - 1] if r else None
            for n, t in live.items():
                t.copy_(new[n])
            want = digest_named(live.items())
            row: dict[str, Any] = {
                "round": r,
                "kind": "initial" if r == 0 else ("real step" if r <= opts.steps else "dense"),
                "changed_fraction": 1.0 if prev is None else changed_fraction(prev, new),
            }
            # full rounds before and after: neither pays or gains from going first
            full_seconds = []
            for i, k in enumerate(("f", "d", "f")):
                stats = trainers[k].send_weights(weight_version=f"r{r}.{i}")
                per = fleets[k][1].checksums()
                if any(d != want for d in per):
                    raise TransferError(f"round {r}: a receiver differs from the trainer")
                key = "delta" if k == "d" else "full"
                row[f"{key}_bytes"] = stats.num_bytes
                row[f"{key}_seconds"] = stats.seconds
                if k == "f":
                    full_seconds.append(stats.seconds)
                    row["full_seconds"] = statistics.mean(full_seconds)
                if k == "d":
                    assert stats.delta is not None
                    row["mode"] = stats.delta["mode"]
                    row["tensors"] = stats.delta["tensors"]
                    row["base_copies"] = stats.delta["base_copies"]
                    row["added_seconds"] = (
                        stats.delta["check_seconds"] + stats.delta["encode_seconds"]
                    )
            rounds.append(row)
    finally:
        for engine in trainers.values():
            engine.shutdown()
        for workers, client in fleets.values():
            client.close()
            for w in workers:
                w.shutdown()
    real = [x for x in rounds if x["kind"] == "real step"]
    # Every element changed, no base copied: the round delta cannot help (the sample path).
    dense = [x for x in rounds if x["kind"] == "dense" and not x["base_copies"]]
    refresh = [x for x in rounds if x["kind"] == "dense" and x["base_copies"]]

    def ratio(rows: list[dict[str, Any]], key: str) -> float | None:
        vals = [x[f"full_{key}"] / x[f"delta_{key}"] for x in rows if x[f"delta_{key}"]]
        return statistics.median(vals) if vals else None

    model_bytes = sum(t.numel() * t.element_size() for t in live.values())
    return {
        "ok": True,
        "settings": {**opts.__dict__, "model_bytes": model_bytes, "tensors": len(live)},
        "train_seconds": train_s,
        "torch": torch.__version__,
        "rounds": rounds,
        "real_steps": {
            "bytes_ratio_median": ratio(real, "bytes"),
            "speedup_median": ratio(real, "seconds"),
        },
        "overhead": {
            "real_median": _median_share(real),
            "dense_median": _median_share(dense),
            "dense_best": min((x["added_seconds"] / x["full_seconds"] for x in dense), default=0.0),
        },
        "dense_steps": {
            "slowdown_median": 1 / (ratio(dense, "seconds") or 1) if dense else None,
            "refresh_slowdown_median": 1 / (ratio(refresh, "seconds") or 1) if refresh else None,
        },
    }


def _median_share(rows: list[dict[str, Any]]) -> float | None:
    vals = [x["added_seconds"] / x["full_seconds"] for x in rows if x["full_seconds"]]
    return statistics.median(vals) if vals else None


def print_delta_table(record: dict[str, Any], out: TextIO) -> None:
    s = record["settings"]
    out.write(
        f"wtcore bench --delta: {s['backend']}, {s['receivers']} receivers, "
        f"model {s['model_bytes'] / 2**20:.1f} MiB in {s['tensors']} tensors (bf16)\n"
    )
    out.write(
        f"{'round':>5} {'kind':<10} {'changed':>8} {'mode':<6} {'delta MiB':>10} "
        f"{'full MiB':>9} {'bytes x':>8} {'delta s':>8} {'full s':>8} {'speedup':>8} "
        f"{'copies':>6}\n"
    )
    for x in record["rounds"]:
        out.write(
            f"{x['round']:>5} {x['kind']:<10} {x['changed_fraction']:>8.2%} {x['mode']:<6} "
            f"{x['delta_bytes'] / 2**20:>10.3f} {x['full_bytes'] / 2**20:>9.3f} "
            f"{x['full_bytes'] / max(x['delta_bytes'], 1):>8.1f} {x['delta_seconds']:>8.4f} "
            f"{x['full_seconds']:>8.4f} {x['full_seconds'] / x['delta_seconds']:>8.2f} "
            f"{x['base_copies']:>6}\n"
        )
    rs, ds = record["real_steps"], record["dense_steps"]
    out.write(
        f"real steps: median {rs['bytes_ratio_median']:.1f}x fewer bytes, "
        f"median speedup {rs['speedup_median']:.2f}x; every element changed: median "
        f"{ds['slowdown_median']:.3f}x the full round's time (rounds that also copy the "
        f"base: {ds['refresh_slowdown_median']:.3f}x)\n"
    )
    ov = record["overhead"]
    out.write(
        f"added by delta (version check + encoding) / full round time, median: real steps "
        f"{ov['real_median']:.1%}, every element changed {ov['dense_median']:.1%} "
        f"(best {ov['dense_best']:.1%})\n"
    )
