"""``wtcore bench --trainer-ranks M``: sharded rounds against gather-then-broadcast, in turns.

``M`` trainer processes (gloo) hold an FSDP2 model (every rank a ``Shard(0)`` of every
tensor). Two fleets of ``N`` HTTP receiver processes on the same engine serve it:
**sharded**, every rank sends its own shards (``ShardedModuleSource``) straight to the
receivers that need them (``layout="tp"``: each holds its TP slice by vLLM's rules; ``replica``:
a whole replica); **gathered**, as users run it today: rank 0 gathers every tensor whole
(``ModuleSource``) and sends the model to every receiver. One round of each, in alternating
order, so a noisy host slows both alike; every round is checked on every receiver and the last
one bit-exact. With ``nodes`` every process runs on a :mod:`wtcore_bench.netns` node of its
own, links capped at ``link_rate``. The roles run as ``python -m wtcore_bench.sharded``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from wtcore_bench.api import BenchNotSupportedError
from wtcore_http_client.commands import TP_PRESETS

__all__ = ["RULES", "ShardedBenchOptions", "print_sharded_table", "run_sharded_bench"]

API_KEY = "bench-sharded-key"
#: vLLM's TP rules for a Llama-like model (``wtcore_kit.synthetic``'s names), as ``wtcore serve``'s.
RULES = TP_PRESETS["llama"]
#: Engines this bench runs sharded rounds on: those that execute plans over a data plane of
#: their own (``inline`` does too, but its bytes go base64 through the control plane).
BACKENDS = ("tcp", "mooncake")


@dataclass
class ShardedBenchOptions:
    backend: str = "tcp"
    trainer_ranks: int = 2
    receivers: int = 2
    layout: str = "tp"  # "tp": receivers hold TP slices; "replica": whole replicas
    size_bytes: int = 256 << 20
    num_tensors: int = 300
    dtype: str = "bfloat16"
    rounds: int = 5  # of each mode, in turns
    buffer_size_bytes: int = 16 << 20
    nodes: bool = False  # every process on a network-namespace node of its own
    link_rate: str | None = None  # with nodes: every node's link capped (tc syntax)
    timeout_s: float = 600.0


def _state(args: argparse.Namespace) -> dict[str, Any]:
    from wtcore_kit.synthetic import synthetic_state

    return synthetic_state(args.size, args.tensors, dtype=args.dtype, seed=0)


def _layout(args: argparse.Namespace, kind: str, index: int) -> Any:
    from wtcore.sharded.receiver_layout import TPLayout

    if kind == "tp" and args.layout == "tp":
        return TPLayout(index, args.receivers, RULES)
    return None


def receiver(args: argparse.Namespace) -> None:
    """One receiver process: an HTTP receiver holding its slice (or a replica)."""
    import torch

    from wtcore import ModuleSink, WeightSyncWorker
    from wtcore_http_client.routes import ReceiverRoutes
    from wtcore_http_client.server import ReceiverHTTPServer
    from wtcore_kit.synthetic import build_module

    torch.set_num_threads(1)
    lay = _layout(args, args.kind, args.index)
    held = {n: torch.zeros_like(lay.local(n, t) if lay else t) for n, t in _state(args).items()}
    worker = WeightSyncWorker(
        args.backend,
        ModuleSink(build_module(held), layout=lay),
        rank=args.index,
        world_size=args.receivers,
    )
    del held
    routes = ReceiverRoutes(worker, api_key=API_KEY)
    with ReceiverHTTPServer(routes, host=args.host, port=0) as server:
        print(f"listening {server.url}", flush=True)
        sys.stdin.read()  # until the driver closes our stdin
    worker.shutdown()


def _expected(args: argparse.Namespace, kind: str) -> list[dict[str, str]]:
    """Each receiver's checksums after the last round: its slices of the model, changed as
    the trainer changed it (one ``add_(1)`` per round: in bf16 not the same as one add)."""
    import torch

    from wtcore.digest import digest_named

    state = _state(args)
    with torch.no_grad():
        for _ in range(args.rounds):
            for t in state.values():
                t.add_(1)
    out = []
    for i in range(args.receivers):
        lay = _layout(args, kind, i)
        out.append(digest_named((n, lay.local(n, t) if lay else t) for n, t in state.items()))
    return out


def _trainer_info(args: argparse.Namespace, rank: int) -> Any:
    common = dict(rank=rank, timeout_s=args.timeout, packed_buffer_size_bytes=args.buffer_size)
    if args.backend == "mooncake":
        from wtcore_mooncake import MooncakeTrainerInitInfo

        return MooncakeTrainerInitInfo(address=args.address, **common)
    from wtcore_tcp import TCPTrainerInitInfo

    return TCPTrainerInitInfo(address=args.address, world_size=1 + args.receivers, **common)


def trainer(args: argparse.Namespace) -> None:
    """One trainer rank: both modes, in turns; rank 0 prints the record as one JSON line."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wtcore import ModuleSource, WeightTransferTrainerFactory
    from wtcore.sharded.source import ShardedModuleSource
    from wtcore_bench.memory import PeakTracker
    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_kit.synthetic import build_module

    torch.set_num_threads(1)
    rank, world = args.rank, args.trainer_ranks
    os.environ.update(MASTER_ADDR=args.master, MASTER_PORT=str(args.master_port))
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    model = build_module(_state(args))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    urls = json.loads(args.urls)
    modes: dict[str, tuple[Any, Any, Any]] = {}
    for mode, kind in (("sharded", "tp"), ("gathered", "whole")):
        client = None
        if rank == 0:
            client = HTTPWeightSyncClient(urls[kind], api_key=API_KEY, timeout_s=args.timeout)
        engine = WeightTransferTrainerFactory.trainer_init(_trainer_info(args, rank), client=client)
        source = ShardedModuleSource(model) if mode == "sharded" else ModuleSource(model)
        modes[mode] = (engine, client, source)
    tracker = PeakTracker([os.getpid()])
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        for mode in ("sharded", "gathered") if r % 2 == 0 else ("gathered", "sharded"):
            engine, client, source = modes[mode]
            dist.barrier()
            tracker.start()
            stats = engine.send_weights(source, weight_version=f"{mode}-{r}")
            # on the wire: each rank its pairs; gathered, rank 0 the model to every receiver
            gathered = stats.num_bytes * args.receivers if rank == 0 else 0
            row: dict[str, Any] = {"round": r, "mode": mode, "seconds": stats.seconds}
            row["sent"] = stats.bytes_sent if mode == "sharded" else gathered
            row["extra_mib"] = tracker.extra_mib()[0]
            if rank == 0:
                row["checked"] = all(
                    i["consistent"]
                    and i["weight_version"] == f"{mode}-{r}"
                    and i["round_bytes"]["landed"] == i["round_bytes"]["planned"] > 0
                    for i in client.weight_info()
                )
            rows.append(row)
    per_rank: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(rows, per_rank, dst=0)
    exact: dict[str, bool] = {}
    if rank == 0:
        for mode, kind in (("sharded", "tp"), ("gathered", "whole")):
            exact[mode] = modes[mode][1].checksums() == _expected(args, kind)
    for engine, client, _ in modes.values():
        engine.shutdown()
        if client is not None:
            client.close()
    # FSDP's modules hold the mesh's groups in reference cycles: freed only by a late garbage
    # collection at exit, after the group was destroyed, they made torch abort ("terminate
    # called without an active exception") in about one exit of twenty.
    del modes, model, source
    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"ranks": per_rank, "exact": exact}), flush=True)


def _spawn(node: Any, argv: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[Any]:
    proc: subprocess.Popen[Any] = (node.popen if node else subprocess.Popen)(argv, env=env, **kw)
    return proc


def _stop(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(Exception):
        if proc.stdin:
            proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _wait_all(trainers: list[subprocess.Popen[Any]], timeout_s: float) -> list[str]:
    """Every trainer rank's stdout; the first rank that fails stops the run, with its stderr."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in trainers) and not any(p.returncode for p in trainers):
        if time.monotonic() > deadline:
            raise BenchNotSupportedError(f"the trainer ranks did not finish in {timeout_s:g} s")
        time.sleep(0.2)
    done = [p for p in trainers if p.returncode] or trainers  # those that failed, else all
    outs = [p.communicate(timeout=60) for p in done]
    for p, (_, err) in zip(done, outs, strict=True):
        if p.returncode:
            r = trainers.index(p)
            raise BenchNotSupportedError(
                f"trainer rank {r} failed ({p.returncode}):\n{err[-4000:]}"
            )
    return [out for out, _ in outs]


def _drive(opts: ShardedBenchOptions) -> dict[str, Any]:
    """Start both fleets and the trainer ranks (each on a node of its own with a link rate)."""
    from wtcore.testing import free_port

    # faulthandler: a rank that dies of a signal leaves every thread's stack in the stderr
    # that the run's error quotes (a bare "failed (-11)" says nothing)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("WTCORE_API_KEY", None)
    m, n = opts.trainer_ranks, opts.receivers
    role = [sys.executable, "-m", "wtcore_bench.sharded"]
    common = [
        "--backend", opts.backend, "--size", str(opts.size_bytes), "--tensors",
        str(opts.num_tensors), "--dtype", opts.dtype, "--receivers", str(n), "--layout",
        opts.layout, "--timeout", repr(opts.timeout_s),
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        nodes: list[Any] = [None] * (m + 2 * n)
        if opts.nodes:
            from wtcore_bench.netns import cluster

            c = stack.enter_context(cluster(m + 2 * n, rate=opts.link_rate, subnet="10.219.0.0/24"))
            nodes = [c[i] for i in range(m + 2 * n)]
            env["GLOO_SOCKET_IFNAME"] = "eth0"  # the node's one interface (wtcore_bench.netns)
        host = [node.address if node is not None else "127.0.0.1" for node in nodes]
        urls: dict[str, list[str]] = {"tp": [], "whole": []}
        fleet = []
        for j, (kind, i) in enumerate([(k, i) for k in ("tp", "whole") for i in range(n)]):
            argv = [*role, "--role", "receiver", "--kind", kind, "--index", str(i),
                    "--host", host[m + j], *common]  # fmt: skip
            proc = _spawn(nodes[m + j], argv, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)  # fmt: skip
            stack.callback(_stop, proc)
            fleet.append(proc)
        for j, proc in enumerate(fleet):
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("listening "):
                raise BenchNotSupportedError(f"receiver {j} did not start (exit {proc.poll()})")
            urls["tp" if j < n else "whole"].append(line.split()[1])
        port = free_port()
        trainers = []
        for r in range(m):
            argv = [*role, "--role", "trainer", "--rank", str(r), "--trainer-ranks", str(m),
                    "--master", host[0], "--master-port", str(port), "--address", host[r],
                    "--urls", json.dumps(urls), "--rounds", str(opts.rounds), "--buffer-size",
                    str(opts.buffer_size_bytes), *common]  # fmt: skip
            proc = _spawn(nodes[r], argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)  # fmt: skip
            stack.callback(_stop, proc)
            trainers.append(proc)
        outs = _wait_all(trainers, opts.timeout_s * 4)
    result: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    return result


def run_sharded_bench(opts: ShardedBenchOptions) -> dict[str, Any]:
    """Run both modes in turns; the record (``record["ok"]``: every round checked, the last
    bit-exact, in both modes)."""
    if opts.backend not in BACKENDS:
        raise BenchNotSupportedError(
            f"--trainer-ranks: sharded rounds are benchmarked on {', '.join(BACKENDS)}, the "
            f"engines that execute plans over a data plane of their own; got {opts.backend!r}"
        )
    if opts.layout not in ("tp", "replica"):
        raise BenchNotSupportedError(f"--layout: expected tp or replica, got {opts.layout!r}")
    if opts.nodes:
        from wtcore_bench.netns import unavailable_reason

        why = unavailable_reason()
        if why:
            raise BenchNotSupportedError(f"--nodes: {why}")
    t0 = time.monotonic()
    got = _drive(opts)
    ranks = got["ranks"]
    record: dict[str, Any] = {"settings": asdict(opts), "exact": got["exact"]}
    for mode in ("sharded", "gathered"):
        rows0 = [x for x in ranks[0] if x["mode"] == mode]
        record[mode] = {
            "median_seconds": statistics.median(x["seconds"] for x in rows0),
            "seconds": [x["seconds"] for x in rows0],
            "checked": all(x["checked"] for x in rows0),
            "sent_per_rank": [
                statistics.median(x["sent"] for x in rr if x["mode"] == mode) for rr in ranks
            ],
            "peak_extra_mib_per_rank": [
                max(x["extra_mib"] or 0.0 for x in rr if x["mode"] == mode) for rr in ranks
            ],
        }
    record["speedup"] = record["gathered"]["median_seconds"] / record["sharded"]["median_seconds"]
    record["ok"] = all(got["exact"].values()) and all(
        record[m]["checked"] for m in ("sharded", "gathered")
    )
    record["wall_seconds"] = time.monotonic() - t0
    return record


def print_sharded_table(rec: dict[str, Any], out: TextIO) -> None:
    s = rec["settings"]
    where = "loopback"
    if s["nodes"]:
        where = f"one node per process, links capped at {s['link_rate'] or 'nothing'}"
    print(f"{s['backend']}, {s['trainer_ranks']} trainer ranks -> {s['receivers']} receivers "
          f"({s['layout']}), {s['size_bytes'] / 2**20:.0f} MiB in {s['num_tensors']} tensors, "
          f"{where}, {s['rounds']} rounds of each in turns", file=out)  # fmt: skip
    for mode in ("sharded", "gathered"):
        x = rec[mode]
        sent = ", ".join(f"{b / 2**20:.1f}" for b in x["sent_per_rank"])
        mem = ", ".join(f"{v:.1f}" for v in x["peak_extra_mib_per_rank"])
        print(f"  {mode:<9} median {x['median_seconds']:.3f} s  sent MiB per rank [{sent}]  "
              f"peak extra MiB per rank [{mem}]  exact {rec['exact'][mode]}", file=out)  # fmt: skip
    print(f"  sharded is {rec['speedup']:.2f}x gather-then-broadcast", file=out)


def main() -> None:
    """The spawned roles (not a user command: run ``wtcore bench --trainer-ranks``)."""
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("receiver", "trainer"), required=True)
    for name in ("--backend", "--kind", "--host", "--master", "--address", "--urls", "--dtype"):
        p.add_argument(name)
    p.add_argument("--layout")
    for name in ("--index", "--rank", "--master-port", "--trainer-ranks", "--receivers",
                 "--size", "--tensors", "--rounds", "--buffer-size"):  # fmt: skip
        p.add_argument(name, type=int)
    p.add_argument("--timeout", type=float)
    args = p.parse_args()
    (receiver if args.role == "receiver" else trainer)(args)
    # Everything is shut down and the output flushed; leave without the interpreter's
    # teardown, as multiprocessing's children do: torch's own at exit can still abort a run
    # that succeeded (see trainer()).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
