"""Where a mooncake round's time goes, next to the ``bare_read`` limit it is measured against.

Runs what ``wtcore bench --backend mooncake --client http --interleave`` runs (``wtcore serve``
receivers, the trainer engine here, one ``bare_read`` call before each round), with timers
hooked into both ends, and splits each receiver's round into: the HTTP calls' transport (client
time minus server time), the worker's own parts of its calls (parsing and checks, memory
registration and unregistration, the engine read itself, the hand-off to and from the read's
thread, the copy into the sink, the rest of the call), and the idle time between its calls.
All timestamps are ``time.monotonic()``, one clock for every process of the host.

    .venv/bin/python benchmarks/mooncake_profile.py --size 256MiB --tensors 300 --rounds 5

The receivers load the hooks through a ``sitecustomize`` in a temporary ``PYTHONPATH`` entry
(``WTCORE_MCPROF``: where they write one JSON line per round).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ENV = "WTCORE_MCPROF"
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- receiver hooks
def install_worker_hooks() -> None:
    """In a ``wtcore serve`` process: time the worker's calls and the engine's parts."""
    import wtcore.sink
    import wtcore.worker
    import wtcore_mooncake.worker as mw
    from wtcore_mooncake import te

    out = Path(os.environ[ENV]) / f"recv-{os.getpid()}.jsonl"
    events: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def note(what: str, t0: float, t1: float) -> None:
        with lock:
            events.append((what, t0, t1))

    def timed(cls: Any, name: str, what: str) -> None:
        orig = getattr(cls, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.monotonic()
            try:
                return orig(*a, **k)
            finally:
                note(what, t0, time.monotonic())

        setattr(cls, name, wrapper)

    W = wtcore.worker.WeightSyncWorker
    timed(W, "start_weight_update", "call:start")
    timed(W, "update_weights", "call:update")
    finish = W.finish_weight_update

    def finish_and_dump(*a: Any, **k: Any) -> Any:
        t0 = time.monotonic()
        try:
            return finish(*a, **k)
        finally:
            note("call:finish", t0, time.monotonic())
            with lock:
                line, events[:] = json.dumps(events), []
            with out.open("a") as f:
                f.write(line + "\n")

    W.finish_weight_update = finish_and_dump  # type: ignore[method-assign]
    E = mw.MooncakeWorkerEngine
    timed(E, "parse_update_info", "parse")
    timed(E, "_lend", "register")
    timed(E, "_unlend", "unregister")
    timed(E, "_wait_read", "wait_read")
    timed(E, "_destination", "destination")
    timed(E, "start_weight_update", "engine_start")
    timed(E, "finish_weight_update", "engine_finish")
    timed(wtcore.sink.ModuleSink, "load_weights", "copy_to_sink")

    class Timed:
        """The transfer engine, its reads timed (they run on the read's own thread)."""

        def __init__(self, engine: Any) -> None:
            self._e = engine

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self._e, name)
            if name not in ("transfer_sync_read", "batch_transfer_sync_read"):
                return attr

            def read(*a: Any) -> Any:
                t0 = time.monotonic()
                try:
                    return attr(*a)
                finally:
                    note("engine_read", t0, time.monotonic())

            return read

    start = te.start
    mw.te.start = lambda *a: (lambda e, ep: (Timed(e), ep))(*start(*a))  # type: ignore[assignment]


# ----------------------------------------------------------------------------- trainer side
def _trainer_hooks(calls: list[tuple[str, str, float, float]]) -> None:
    from wtcore_http_client.client import HTTPWeightSyncClient

    orig = HTTPWeightSyncClient._call

    def _call(self: Any, url: str, call: str, *a: Any, **k: Any) -> Any:
        t0 = time.monotonic()
        try:
            return orig(self, url, call, *a, **k)
        finally:
            calls.append((url, call, t0, time.monotonic()))

    HTTPWeightSyncClient._call = _call  # type: ignore[method-assign]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _split(
    events: list[list[Any]], client: list[tuple[str, float, float]], window: tuple[float, float]
) -> dict[str, float]:
    """One receiver's round, in seconds by part (they add up to the round's wall time)."""
    by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for what, t0, t1 in events:
        by[what].append((t0, t1))
    d = {k: sum(b - a for a, b in v) for k, v in by.items()}
    server = _union([s for k, v in by.items() if k.startswith("call:") for s in v])
    read = d.get("engine_read", 0.0)
    out = {
        "engine_read": read,
        "read_handoff": d.get("wait_read", 0.0) - read,
        "register": d.get("register", 0.0),  # most of it inside destination (_lend)
        "unregister": d.get("unregister", 0.0),
        "copy_to_sink": d.get("copy_to_sink", 0.0),
        "parse_checks": d.get("parse", 0.0),
        "engine_start_finish": d.get("engine_start", 0.0) + d.get("engine_finish", 0.0),
    }
    out["destination_lookup"] = d.get("destination", 0.0) - d.get("register", 0.0)
    # the worker's own bookkeeping of its calls (round state, ledger, layers)
    out["calls_rest"] = server - sum(out.values())
    out["http_transport"] = sum(b - a for _, a, b in client) - server
    out["idle"] = (window[1] - window[0]) - server - out["http_transport"]
    out["round"] = window[1] - window[0]
    return out


def main() -> int:
    import torch

    from wtcore.source import ModuleSource
    from wtcore.units import parse_size
    from wtcore_bench.api import BaselineContext, ModelSpec
    from wtcore_bench.fleet import launch_fleet
    from wtcore_bench.support.mooncake import BENCH, bare_read_session
    from wtcore_kit.synthetic import build_module
    from wtcore_mooncake.trainer import MooncakeTrainerEngine

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--buffer-size", default=None, help="default: the engine's")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="wtcore-mcprof-"))
    (tmp / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
        "import mooncake_profile\nmooncake_profile.install_worker_hooks()\n"
    )
    calls: list[tuple[str, str, float, float]] = []
    _trainer_hooks(calls)
    spec = ModelSpec(parse_size(args.size), args.tensors, "bfloat16")
    state = spec.build_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffer = None if args.buffer_size is None else parse_size(args.buffer_size)
    rounds: list[dict[str, Any]] = []  # bare_s, seconds, window, phases, calls by receiver URL
    with contextlib.ExitStack() as stack:
        bare = stack.enter_context(
            bare_read_session(BaselineContext(state, nbytes, args.receivers))
        )
        bare()  # warm-up, as the bench's
        os.environ[ENV] = str(tmp)  # only the receivers started from here on load the hooks
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tmp), os.environ.get("PYTHONPATH")])
        )
        model = build_module(state)
        torch.set_num_threads(1)
        fleet = launch_fleet("http", "mooncake", args.receivers, spec, timeout_s=300)
        stack.callback(fleet.close)
        info = BENCH.init_info(
            MooncakeTrainerEngine, receivers=args.receivers, host="127.0.0.1",
            buffer_size_bytes=buffer,
        )  # fmt: skip
        engine = MooncakeTrainerEngine.trainer_init(
            info, source=ModuleSource(model), client=fleet.client
        )
        stack.callback(engine.shutdown)
        for r in range(args.rounds):
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(1)
            t0 = time.perf_counter()
            bare()
            bare_s = time.perf_counter() - t0
            calls.clear()
            t0 = time.monotonic()
            stats = engine.send_weights(weight_version=f"prof-{r}")
            t1 = time.monotonic()
            per_url: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
            for url, call, a, b in calls:
                per_url[url].append((call, a, b))
            rounds.append(
                {"bare_s": bare_s, "seconds": t1 - t0, "window": (t0, t1), "calls": per_url,
                 "phases": {k: round(v, 3) for k, v in stats.phase_seconds.items()},
                 "buckets": stats.num_buckets}
            )  # fmt: skip
        urls = [s.url for s in fleet.servers]  # type: ignore[attr-defined]
        pids = fleet.pids()
    print(
        f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, {args.receivers} receivers, "
        f"buffer {args.buffer_size or 'default'}, {rounds[0]['buckets']} bucket(s), "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'round':>5} {'bare s':>7} {'round s':>7} {'ratio':>6}  trainer phases")
    for r, row in enumerate(rounds):
        ratio = row["bare_s"] / row["seconds"]
        print(f"{r:>5} {row['bare_s']:7.3f} {row['seconds']:7.3f} {ratio:6.2f}  {row['phases']}")
    ratio = statistics.median(x["bare_s"] for x in rounds) / statistics.median(
        x["seconds"] for x in rounds
    )
    print(f"median ratio (engine GB/s / bare_read GB/s): {ratio:.2f}")
    for i, (url, pid) in enumerate(zip(urls, pids, strict=True)):
        f = tmp / f"recv-{pid}.jsonl"
        got = [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []
        splits = [
            _split(ev, row["calls"][url], row["window"])
            for ev, row in zip(got, rounds, strict=False)
        ]
        if not splits:
            continue
        use = splits[1:] or splits  # round 0 warms up
        print(f"\nreceiver {i}: ms per round, the median of rounds 1.., then each round")
        for k in splits[0]:
            each = " ".join(f"{s[k] * 1e3:7.1f}" for s in splits)
            print(f"  {k:<20} {statistics.median(s[k] for s in use) * 1e3:8.1f}   {each}")
        w0 = rounds[len(splits) - 1]["window"][0]
        print("  the last round's calls and reads (ms from send_weights):")
        spans = [(w, a, b) for w, a, b in got[-1] if w.startswith("call:") or w == "engine_read"]
        spans += [(f"client:{c}", a, b) for c, a, b in rounds[len(splits) - 1]["calls"][url]]
        for what, a, b in sorted(spans, key=lambda e: e[1]):
            print(f"    {what:<30} {(a - w0) * 1e3:8.1f} -> {(b - w0) * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
