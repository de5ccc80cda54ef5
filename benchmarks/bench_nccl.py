"""Benchmark the nccl engine (gloo on CPU) against the raw gloo limit and a naive baseline.

Not a test: run it by hand, ideally on an otherwise idle machine, and compare the ratios
taken within one run (the absolute numbers move with the load of the host)::

    .venv/bin/python benchmarks/bench_nccl.py                  # 1 GiB, fp32 + bf16, 1 and 2 receivers
    .venv/bin/python benchmarks/bench_nccl.py --size 64MiB --repeats 2

For every dtype and receiver count it reports, in GB/s of model bytes per round (median):

* ``packed@<buffer>``: the nccl engine, packed, for several buffer sizes (2 buffers);
* ``unpacked``: the nccl engine, one broadcast per tensor;
* ``raw``: one preallocated buffer of the model's size broadcast with plain gloo (the limit);
* ``naive``: per tensor, a control call (pipe round trip) announcing it, a fresh receive
  tensor, a broadcast and a load: what a straightforward implementation does.

and the peak extra RSS of the sender and of the receivers during the engine runs (the target
is at most ``buffer x num_buffers + largest tensor``). Receivers are real processes driven
through the shared pipe control plane (``wtcore.testing.pipes``, via
``tests/nccl/nccl_e2e_kit.py``); ``raw`` and ``naive`` are the baselines of ``wtcore bench``
(``wtcore_bench.limits``), measured with their own receiver processes after the engine runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "nccl"))

from nccl_e2e_kit import fleet, spec_of

from wtcore import TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.testing import free_port, synthetic_state
from wtcore.testing.pipes import Handlers
from wtcore.units import parse_size
from wtcore_bench.limits import per_tensor_gbps, raw_gloo_gbps
from wtcore_nccl import NCCLTrainerInitInfo

TIMEOUT_S = 120.0
_BINARY = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}


def fmt_size(n: int) -> str:
    """Exact binary sizes as compact labels (``packed@64MiB``)."""
    for unit, mult in _BINARY.items():
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


# ---------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_reset() -> int:
    """Reset the peak-RSS mark (Linux ``clear_refs`` 5) and return the current RSS in bytes.

    Freed heap memory is first handed back to the OS (``malloc_trim``), so that buffers of an
    earlier run cannot hide the allocations of the next one.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def rss_peak() -> int:
    return _status_kib("VmHWM") * 1024


# ---------------------------------------------------------------------- receiver handlers
def bench_handlers(worker: WeightSyncWorker) -> Handlers:
    """Extra receiver commands: RSS marks and a cheap check of what the model holds."""
    params = dict(worker.sink.module.named_parameters())  # type: ignore[attr-defined]
    return {
        "rss_reset": rss_reset,
        "rss_peak": rss_peak,
        "check": lambda name: float(params[name].detach().float().sum()),
    }


# ---------------------------------------------------------------------- sender side
def run_engine(
    f: Any,
    num_buffers: int,
    state: dict[str, torch.Tensor],
    n: int,
    *,
    packed: bool,
    buffer: int,
    repeats: int,
) -> dict[str, Any]:
    client = f.client
    sender_base = rss_reset()
    recv_base = [client.call(i, "rss_reset") for i in range(n)]
    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=1 + n,
        packed=packed,
        packed_buffer_size_bytes=buffer,
        packed_num_buffers=num_buffers,
        timeout_s=TIMEOUT_S,
        torch_num_threads=1,
        rank=0,
    )
    times = []
    source = TensorSource(state)
    with WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer:
        trainer.send_weights(source, weight_version="warmup")  # allocates the reused buffers
        for r in range(repeats):
            t0 = time.perf_counter()
            trainer.send_weights(source, weight_version=f"r{r}")
            times.append(time.perf_counter() - t0)
        sender_peak = rss_peak() - sender_base
        recv_peak = max(client.call(i, "rss_peak") - recv_base[i] for i in range(n))
    name = next(iter(state))
    want = float(state[name].float().sum())
    for i in range(n):
        assert client.call(i, "check", name) == want, "receiver holds other weights"
    return {
        "seconds": statistics.median(times),
        "sender_extra_rss": sender_peak,
        "receiver_extra_rss": recv_peak,
    }


def _mib(row: dict[str, Any], key: str) -> str:
    return f"{row[key] / (1 << 20):.0f} MiB" if key in row else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="model size (default 1GiB)")
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--receivers", default="1,2")
    p.add_argument("--buffers", default="16MiB,64MiB,256MiB", help="packed buffer sizes")
    p.add_argument("--num-buffers", type=int, default=2, help="packed_num_buffers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # torch's spinning threads starve gloo on small hosts (docs/nccl.md)
    size = parse_size(args.size)
    buffers = [parse_size(b) for b in args.buffers.split(",")]
    results: list[dict[str, Any]] = []
    print(
        f"nccl engine benchmark (gloo, CPU), model {fmt_size(size)}, {args.repeats} repeats; "
        "GB/s = model bytes / seconds per round"
    )
    for dtype in args.dtypes.split(","):
        state = synthetic_state(size, args.tensors, dtype)
        total = sum(t.numel() * t.element_size() for t in state.values())
        largest = max(t.numel() * t.element_size() for t in state.values())
        for n in (int(x) for x in args.receivers.split(",")):
            with fleet(n, spec_of(state), timeout_s=TIMEOUT_S, extra=bench_handlers) as f:
                rows: dict[str, dict[str, Any]] = {}
                # Unpacked first: buffers freed by an earlier run could otherwise be reused
                # by the allocator and hide this run's allocations from the RSS mark.
                rows["unpacked"] = run_engine(
                    f,
                    args.num_buffers,
                    state,
                    n,
                    packed=False,
                    buffer=buffers[0],
                    repeats=args.repeats,
                )
                rows["unpacked"]["target_rss"] = args.num_buffers * largest + largest
                for b in buffers:
                    row = run_engine(
                        f, args.num_buffers, state, n, packed=True, buffer=b, repeats=args.repeats
                    )
                    row["target_rss"] = args.num_buffers * min(b, total) + largest
                    rows[f"packed@{fmt_size(b)}"] = row
            # The limits start their own receivers: only after the fleet is gone.
            raw_gbps = raw_gloo_gbps(total, n, args.repeats)
            naive_gbps = per_tensor_gbps(state, n, max(1, args.repeats))
            rows["raw"] = {"seconds": total / raw_gbps / 1e9}
            rows["naive"] = {"seconds": total / naive_gbps / 1e9}
            print(
                f"\n{dtype}, {len(state)} tensors, {total / 1e9:.3f} GB, {n} receiver(s); "
                f"largest tensor {fmt_size(largest) if largest % 1024 == 0 else largest}"
            )
            print(
                f"  {'mode':<16}{'GB/s':>7}{'x raw':>8}{'x naive':>9}"
                f"{'sender +RSS':>14}{'recv +RSS':>12}{'target':>10}"
            )
            for mode, r in rows.items():
                gbps = total / r["seconds"] / 1e9
                r.update(
                    mode=mode,
                    dtype=dtype,
                    receivers=n,
                    bytes=total,
                    gbps=gbps,
                    x_raw=gbps / raw_gbps,
                    x_naive=gbps / naive_gbps,
                )
                print(
                    f"  {mode:<16}{gbps:7.2f}{gbps / raw_gbps:8.2f}{gbps / naive_gbps:9.2f}"
                    f"{_mib(r, 'sender_extra_rss'):>14}{_mib(r, 'receiver_extra_rss'):>12}"
                    f"{_mib(r, 'target_rss'):>10}"
                )
                results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
