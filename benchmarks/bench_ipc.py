"""Benchmark the ``ipc`` engine (CPU, POSIX shared memory) against its limits, in one run.

    .venv/bin/python benchmarks/bench_ipc.py                 # 1 GiB, ~300 tensors
    .venv/bin/python benchmarks/bench_ipc.py --size 64MiB --rounds 2

Four numbers, all for the same synthetic model (``wtcore.synthetic_state``):

* ``ipc``: ``send_weights`` from this process into ONE worker process (its own model, loaded
  through ``WeightSyncWorker`` -> ``ModuleSink``), control plane the shared pipe client of
  ``wtcore.testing.pipes`` (JSON only).
* ``memcpy``: one copy of the whole model into a preallocated buffer, single process: the
  limit (the ipc engine makes two copies: pack, then the worker's copy out).
* ``shm_copy``: one copy out of a shared-memory segment that already holds the weights: the
  ceiling of the worker's half.
* ``file``: the naive baseline: ``torch.save`` to a file, ``torch.load``, copy into the model.

The baselines are those of ``wtcore bench`` (``wtcore_bench.limits``), so the numbers of this
script and of the bench compare. Every measurement runs ``--rounds`` times (the engine after
one warm-up); the median is reported. The machine is shared and noisy: compare the ratios of
one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

from wtcore.units import parse_size


def make_worker(spec: dict[str, Any]) -> Any:
    """Runs in the worker process: an ipc ``WeightSyncWorker`` over a zero model of ``spec``."""
    import torch

    from wtcore import ModuleSink, WeightSyncWorker
    from wtcore.meta import metas_from_wire
    from wtcore.testing import build_module

    torch.set_num_threads(1)
    metas = metas_from_wire(spec["names"], spec["dtype_names"], spec["shapes"])
    module = build_module({m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas})
    return WeightSyncWorker("ipc", ModuleSink(module))


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
    from wtcore.testing.pipes import pipe_fleet
    from wtcore_ipc import IPCTrainerInitInfo

    spec = metas_to_wire([ParamMeta.of(n, t) for n, t in state.items()])
    # pipe_fleet stops the worker (kill by PID as the last resort) however this ends
    with pipe_fleet(
        [functools.partial(make_worker, spec)], timeout_s=300.0, ready_timeout_s=300.0
    ) as fleet:
        info = IPCTrainerInitInfo(
            packed_buffer_size_bytes=buffer, packed_num_buffers=num_buffers, timeout_s=300, rank=0
        )
        with WeightTransferTrainerFactory.trainer_init(
            info, client=fleet.client, source=TensorSource(state)
        ) as trainer:
            return timed(lambda: trainer.send_weights(weight_version="bench"), rounds)


def main() -> None:
    import torch

    from wtcore.testing import synthetic_state
    from wtcore_bench.api import BaselineContext
    from wtcore_bench.limits import file_gbps, memcpy_gbps
    from wtcore_bench.support.ipc import shm_copy_gbps

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="model size (e.g. 1GiB, 64MiB); default 1GiB")
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds after a warm-up")
    ap.add_argument("--buffer", default="16MiB", help="ipc bucket (slot) size (default 16MiB)")
    ap.add_argument("--num-buffers", type=int, default=4)
    ap.add_argument("--skip-file", action="store_true", help="skip the slow file baseline")
    args = ap.parse_args()
    torch.set_num_threads(1)  # busy-waiting torch threads starve a 2-core host (docs/benchmarks.md)

    state = synthetic_state(parse_size(args.size), args.tensors, "float32")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffer = parse_size(args.buffer)
    gbps = {
        "memcpy": memcpy_gbps(nbytes, args.rounds),
        "shm_copy": shm_copy_gbps(BaselineContext(state, nbytes, receivers=1), args.rounds),
        "ipc": nbytes / bench_ipc(state, args.rounds, buffer, args.num_buffers) / 1e9,
    }
    if not args.skip_file:
        gbps["file"] = file_gbps(state, args.rounds)
    print(
        f"model: {nbytes / 2**30:.3f} GiB in {len(state)} tensors; ipc buffer {buffer} B "
        f"x {args.num_buffers}; median of {args.rounds} rounds"
    )
    for k, v in gbps.items():
        print(f"  {k:8s} {v:7.2f} GB/s  ({nbytes / v / 1e6:8.1f} ms)")
    ratios = {
        "ipc_vs_memcpy": gbps["ipc"] / gbps["memcpy"],
        "ipc_vs_shm_copy": gbps["ipc"] / gbps["shm_copy"],
    }
    if "file" in gbps:
        ratios["ipc_vs_file"] = gbps["ipc"] / gbps["file"]
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    print(json.dumps({"bytes": nbytes, "tensors": len(state), "gbps": gbps, "ratios": ratios}))


if __name__ == "__main__":
    main()
