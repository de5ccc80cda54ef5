"""Benchmark the ``ipc`` engine (CPU, POSIX shared memory) against its limits, in one run.

    .venv/bin/python benchmarks/bench_ipc.py                 # 1 GiB, ~300 tensors
    .venv/bin/python benchmarks/bench_ipc.py --size 64MiB --rounds 2

Three numbers, all for the same synthetic model (``wtcore.testing.synthetic_state``):

* ``ipc``: ``send_weights`` from this process into ONE worker process (its own model, loaded
  through ``WeightSyncWorker`` -> ``ModuleSink``), control plane a local pipe carrying JSON.
* ``memcpy``: one copy of the whole model into a preallocated buffer, single process: the
  limit (the ipc engine makes two copies: pack, then the worker's copy out).
* ``file``: the naive baseline: ``torch.save`` to a file, ``torch.load``, copy into the model.

Every measurement runs ``--rounds`` times after one warm-up; the median is reported. The
machine is shared and noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for unit, mult in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


# ---------------------------------------------------------------------- worker process
def worker_main(conn: Any, spec: dict[str, Any]) -> None:
    """A receiver: JSON requests in, JSON answers out (no pickle of payloads)."""
    import torch

    from wtcore import ModuleSink, WeightSyncWorker
    from wtcore.meta import metas_from_wire
    from wtcore.testing import build_module

    torch.set_num_threads(1)
    metas = metas_from_wire(spec["names"], spec["dtype_names"], spec["shapes"])
    module = build_module({m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas})
    worker = WeightSyncWorker("ipc", ModuleSink(module))
    conn.send_bytes(b'{"ok": true}')
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except EOFError:
            break
        if req["call"] == "exit":
            break
        try:
            getattr(worker, req["call"])(*req["args"])
            conn.send_bytes(b'{"ok": true}')
        except Exception as e:
            conn.send_bytes(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode())
    worker.shutdown()


class PipeClient:
    """The trainer's blocking client over a multiprocessing pipe, JSON bytes only."""

    def __init__(self, conn: Any, timeout_s: float = 300.0) -> None:
        self.conn = conn
        self.timeout_s = timeout_s

    def _call(self, call: str, *args: Any) -> None:
        self.conn.send_bytes(json.dumps({"call": call, "args": list(args)}).encode())
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"{call}: no answer within {self.timeout_s} s")
        msg = json.loads(self.conn.recv_bytes())
        if not msg["ok"]:
            raise RuntimeError(f"{call}: {msg['error']}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


# ---------------------------------------------------------------------- measurements
def timed(fn: Any, rounds: int) -> float:
    fn()  # warm-up: page faults, first-touch of buffers
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_ipc(state: dict[str, Any], rounds: int, buffer: int, num_buffers: int) -> float:
    from wtcore import TensorSource, WeightTransferTrainerFactory
    from wtcore.meta import ParamMeta, metas_to_wire
    from wtcore_ipc import IPCTrainerInitInfo

    spec = metas_to_wire([ParamMeta.of(n, t) for n, t in state.items()])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker_main, args=(child, spec), daemon=True)
    proc.start()
    trainer = None
    try:
        if not parent.poll(300):
            raise TimeoutError("worker did not start within 300 s")
        parent.recv_bytes()
        info = IPCTrainerInitInfo(
            packed_buffer_size_bytes=buffer, packed_num_buffers=num_buffers, timeout_s=300, rank=0
        )
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=PipeClient(parent), source=TensorSource(state)
        )
        return timed(lambda: trainer.send_weights(weight_version="bench"), rounds)
    finally:
        if trainer is not None:
            trainer.shutdown()
        try:
            parent.send_bytes(b'{"call": "exit"}')
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def bench_memcpy(state: dict[str, Any], rounds: int) -> float:
    import torch

    from wtcore.buckets import as_bytes

    total = sum(t.numel() * t.element_size() for t in state.values())
    src = torch.empty(total, dtype=torch.uint8)
    off = 0
    for t in state.values():
        n = t.numel() * t.element_size()
        src[off : off + n].copy_(as_bytes(t))
        off += n
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), rounds)


def bench_file(state: dict[str, Any], rounds: int) -> float:
    import torch

    from wtcore.testing import build_module, zeros_like_state

    model = dict(build_module(zeros_like_state(state)).named_parameters())
    fd, path = tempfile.mkstemp(suffix=".pt")
    os.close(fd)

    def once() -> None:
        torch.save(state, path)
        loaded = torch.load(path, weights_only=True)
        with torch.no_grad():
            for name, t in loaded.items():
                model[name].copy_(t)

    try:
        return timed(once, rounds)
    finally:
        os.unlink(path)


def main() -> None:
    import torch

    from wtcore.testing import synthetic_state

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="model size (e.g. 1GiB, 64MiB); default 1GiB")
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds after a warm-up")
    ap.add_argument("--buffer", default="64MiB", help="ipc bucket size (default 64MiB)")
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--skip-file", action="store_true", help="skip the slow file baseline")
    args = ap.parse_args()
    torch.set_num_threads(1)  # PERF_NOTES: busy-waiting torch threads starve 2 cores

    state = synthetic_state(parse_size(args.size), args.tensors, "float32")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffer = parse_size(args.buffer)
    results = {
        "memcpy": bench_memcpy(state, args.rounds),
        "ipc": bench_ipc(state, args.rounds, buffer, args.num_buffers),
    }
    if not args.skip_file:
        results["file"] = bench_file(state, args.rounds)
    gbps = {k: nbytes / s / 1e9 for k, s in results.items()}
    print(
        f"model: {nbytes / 2**30:.3f} GiB in {len(state)} tensors; ipc buffer {buffer} B "
        f"x {args.num_buffers}; median of {args.rounds} rounds"
    )
    for k, v in gbps.items():
        print(f"  {k:7s} {v:7.2f} GB/s  ({results[k] * 1e3:8.1f} ms)")
    ratios = {"ipc_vs_memcpy": gbps["ipc"] / gbps["memcpy"]}
    if "file" in gbps:
        ratios["ipc_vs_file"] = gbps["ipc"] / gbps["file"]
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    print(json.dumps({"bytes": nbytes, "tensors": len(state), "gbps": gbps, "ratios": ratios}))


if __name__ == "__main__":
    main()
