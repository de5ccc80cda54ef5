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
through the pipe control plane of ``tests/nccl/nccl_e2e_kit.py``.
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

from nccl_e2e_kit import Handlers, fleet, spec_of

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.meta import dtype_from_name
from wtcore.testing import free_port, synthetic_state
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_nccl.group import GENERATION_KEY, connect_store, host_store, join_group
from wtcore_nccl.pipeline import wait_work

TIMEOUT_S = 120.0
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}


def parse_size(text: str) -> int:
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def fmt_size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
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
def bench_handlers(worker: Any, module: torch.nn.Module) -> Handlers:
    """Extra receiver commands: RSS marks, a plain gloo group, the raw and naive baselines."""
    params = dict(module.named_parameters())
    plain: dict[str, Any] = {}

    def plain_join(port: int, rank: int, world_size: int) -> None:
        store = connect_store("127.0.0.1", port, TIMEOUT_S)
        gen = int(store.get(GENERATION_KEY))
        plain["store"] = store
        plain["group"] = join_group(
            store,
            generation=gen,
            rank=rank,
            world_size=world_size,
            transport="gloo",
            address="127.0.0.1",
            port=port,
            timeout_s=TIMEOUT_S,
        )

    def plain_leave() -> None:
        plain.clear()

    def raw_prepare(nbytes: int) -> None:
        plain["raw"] = torch.empty(nbytes, dtype=torch.uint8)
        plain["raw"].fill_(0)  # fault the pages in: the raw limit uses a warm buffer

    def raw_recv() -> None:
        wait_work(plain["group"].broadcast(plain["raw"]), what="raw", timeout_s=TIMEOUT_S)

    def naive_one(name: str, dtype: str, shape: list[int]) -> None:
        t = torch.empty(shape, dtype=dtype_from_name(dtype))  # fresh, as naive code does
        if t.numel():
            wait_work(
                plain["group"].broadcast(t.reshape(-1).view(torch.uint8)),
                what=name,
                timeout_s=TIMEOUT_S,
            )
        worker.sink.load_weights([(name, t)])

    return {
        "rss_reset": rss_reset,
        "rss_peak": rss_peak,
        "plain_join": plain_join,
        "plain_leave": plain_leave,
        "raw_prepare": raw_prepare,
        "raw_recv": raw_recv,
        "naive_one": naive_one,
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


def run_plain(f: Any, state: dict[str, torch.Tensor], n: int, repeats: int) -> dict[str, Any]:
    """The raw limit and the naive baseline, on one plain gloo group."""
    from wtcore.concurrency import BackgroundCall
    from wtcore.fanout import fan_out

    client = f.client
    port = free_port()
    store = host_store("127.0.0.1", port, 1 + n, TIMEOUT_S)
    store.add(GENERATION_KEY, 1)
    joins = [BackgroundCall(client.call, i, "plain_join", port, 1 + i, 1 + n) for i in range(n)]
    group = join_group(
        store,
        generation=1,
        rank=0,
        world_size=1 + n,
        transport="gloo",
        address="127.0.0.1",
        port=port,
        timeout_s=TIMEOUT_S,
    )
    for j in joins:
        j.result(TIMEOUT_S)
    total = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {}
    try:
        raw = torch.empty(total, dtype=torch.uint8)
        raw.fill_(1)
        fan_out(
            "raw_prepare",
            [(str(i), lambda i=i: client.call(i, "raw_prepare", total)) for i in range(n)],
            timeout_s=TIMEOUT_S,
        )
        times = []
        for _ in range(repeats + 1):
            calls = [BackgroundCall(client.call, i, "raw_recv") for i in range(n)]
            t0 = time.perf_counter()
            wait_work(group.broadcast(raw), what="raw", timeout_s=TIMEOUT_S)
            for c in calls:
                c.result(TIMEOUT_S)
            times.append(time.perf_counter() - t0)
        out["raw"] = statistics.median(times[1:])
        del raw
        fan_out(
            "raw_prepare",
            [(str(i), lambda i=i: client.call(i, "raw_prepare", 0)) for i in range(n)],
            timeout_s=TIMEOUT_S,
        )
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            for name, t in state.items():
                dname = str(t.dtype).split(".")[-1]
                calls = [
                    BackgroundCall(client.call, i, "naive_one", name, dname, list(t.shape))
                    for i in range(n)
                ]
                if t.numel():
                    wait_work(
                        group.broadcast(t.reshape(-1).view(torch.uint8)),
                        what=name,
                        timeout_s=TIMEOUT_S,
                    )
                for c in calls:
                    c.result(TIMEOUT_S)
            times.append(time.perf_counter() - t0)
        out["naive"] = statistics.median(times)
    finally:
        fan_out(
            "plain_leave",
            [(str(i), lambda i=i: client.call(i, "plain_leave")) for i in range(n)],
            timeout_s=TIMEOUT_S,
        )
        group.pg = None
    return out


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
    torch.set_num_threads(1)  # PERF_NOTES: torch's spinning threads starve gloo on small hosts
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
                plain = run_plain(f, state, n, args.repeats)
                rows["raw"] = {"seconds": plain["raw"]}
                rows["naive"] = {"seconds": plain["naive"]}
            raw_gbps = total / rows["raw"]["seconds"] / 1e9
            naive_gbps = total / rows["naive"]["seconds"] / 1e9
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
