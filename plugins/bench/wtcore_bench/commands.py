"""``wtcore bench``: the command line of the bench, added to ``wtcore`` through its hook.

Loaded with the plugin manager on every ``wtcore`` command, so nothing heavy is imported at
module level: the bench itself is imported when ``bench`` runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from wtcore.hookspecs import hookimpl
from wtcore.parse import size_argument, sizes_argument
from wtcore_bench.baselines import BASELINE_SETS

__all__ = ["wtcore_add_commands"]


@hookimpl
def wtcore_add_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    b = subparsers.add_parser(
        "bench",
        help="sync a synthetic model to receivers it starts, verify, and measure against baselines",
    )
    b.add_argument("--backend", default="inline", help="engine name (default: inline)")
    b.add_argument(
        "--client", default="inproc", help="client name, see `wtcore plugins` (default: inproc)"
    )
    b.add_argument("--receivers", type=int, default=2, help="number of receivers (default 2)")
    b.add_argument(
        "--size",
        type=size_argument,
        default=size_argument("64MiB"),
        help="model size (default 64MiB)",
    )
    b.add_argument("--tensors", type=int, default=100, help="number of tensors (default 100)")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--rounds", type=int, default=3, help="rounds per configuration (default 3)")
    b.add_argument(
        "--buffer-size",
        type=sizes_argument,
        default=[],
        help="bucket buffer size, or a comma-separated list to sweep (default: the engine's)",
    )
    b.add_argument(
        "--baselines",
        default="auto",
        choices=BASELINE_SETS,
        help="baselines to measure in the same run: limits, naive baselines, peers (auto: the "
        "generic ones and the backend's; peers: those plus what you would use instead of "
        "wtcore, from every installed plugin; all: every installed engine's and every peer)",
    )
    b.add_argument(
        "--interleave",
        action="store_true",
        help="measure the baselines that can run round by round (memcpy, a raw collective) in "
        "turns with the engine's rounds, one call before each, instead of all before them: on "
        "a shared host a limit moves by a third within a minute",
    )
    b.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the model, staging buffers and receivers' models live (default cpu)",
    )
    b.add_argument("--transactional", action="store_true", help="receivers stage each round")
    b.add_argument(
        "--staged",
        action="store_true",
        help="staged rounds (receivers stage, prepare, then commit) and classic rounds in turns, "
        "each on its own fleet; the table and JSON give each receiver's paused time",
    )
    b.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads in the trainer while it sends (default 1: on small hosts torch's "
        "busy-waiting workers starve the transfer; 0 keeps torch's default)",
    )
    b.add_argument("--timeout", type=float, default=300.0, help="seconds per call (default 300)")
    b.add_argument("--json", metavar="PATH", help="write the full record as JSON")
    b.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s against buffer size")
    b.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set a field of the engine's init info (VALUE is JSON, or else a string), e.g. "
        "topology=chain for tcp; repeatable",
    )
    b.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="run the receivers on N network-namespace nodes and the trainer on one more "
        "(root and iproute2 only; needs a network client such as --client http)",
    )
    b.add_argument(
        "--link-rate",
        default=None,
        metavar="RATE",
        help="with --nodes: cap every node's link to RATE each way (tc syntax: 1gbit, 100mbit) "
        "and report the achieved rate against it",
    )
    b.add_argument("--corrupt-round", type=int, default=None, help=argparse.SUPPRESS)
    b.add_argument(
        "--delta",
        action="store_true",
        help="delta rounds against full rounds on real training steps (wtcore_bench.delta); "
        "uses --backend, --receivers, --timeout, --json, --torch-threads and --delta-* only",
    )
    b.add_argument(
        "--trainer-ranks",
        type=int,
        default=None,
        metavar="M",
        help="sharded rounds from M trainer processes (FSDP2) against gather-then-broadcast, "
        "in turns (wtcore_bench.sharded); uses --backend (tcp or mooncake), --receivers, "
        "--layout, --size, --tensors, --dtype, --rounds, --buffer-size, --nodes, --link-rate, "
        "--timeout, --json",
    )
    b.add_argument(
        "--layout",
        choices=["tp", "replica"],
        default="tp",
        help="with --trainer-ranks: the receivers hold TP slices (tp, default) or whole "
        "replicas (replica)",
    )
    b.add_argument(
        "--plan-only",
        action="store_true",
        help="plan a simulated sharded round, no processes (wtcore_bench.plan): one trainer "
        "rank's and one receiver's planning time, peak memory, pairs and bytes; uses "
        "--trainer-ranks (default 8), --receivers, --plan-layout, --json",
    )
    b.add_argument(
        "--plan-layout",
        choices=["dense", "moe"],
        default="dense",
        help="with --plan-only: a 70B-like dense model (default) or a 235B-A22B-like MoE",
    )
    b.add_argument("--delta-steps", type=int, default=8, help="real training steps (default 8)")
    b.add_argument(
        "--delta-width", type=int, default=256, help="the trained model's d_model (default 256)"
    )
    b.add_argument(
        "--delta-mode",
        choices=["on", "auto"],
        default="on",
        help="the delta trainer's delta option: on (delta=True, always try) or auto "
        "(delta='auto', only when earlier rounds say it is faster); default on",
    )
    b.set_defaults(func=_cmd_bench)


def _usage(message: str) -> int:
    print(f"wtcore bench: {message}", file=sys.stderr)
    return 2


def _cmd_bench(args: argparse.Namespace) -> int:
    from wtcore_bench import BenchOptions, run_bench
    from wtcore_bench.report import check_plot_available, print_table, write_json, write_plot

    if args.receivers < 1 or args.rounds < 1:
        return _usage("--receivers and --rounds must be at least 1")
    if args.delta:
        return _cmd_bench_delta(args)
    if args.plan_only:
        from wtcore_bench.plan import print_plan_table, run_plan_bench

        m = 8 if args.trainer_ranks is None else args.trainer_ranks
        if m < 1:
            return _usage("--trainer-ranks must be at least 1")
        return _report(
            run_plan_bench(args.plan_layout, m, args.receivers), print_plan_table, args.json
        )
    if args.trainer_ranks is not None:
        return _cmd_bench_sharded(args)
    if args.plot:
        check_plot_available()  # fail in one line now, not after the whole run
    if args.link_rate is not None and not args.nodes:
        return _usage("--link-rate needs --nodes")
    engine_options = _engine_options(args.engine_option)
    if args.nodes:
        record = _bench_on_nodes(args)
    else:
        record = run_bench(
            BenchOptions(
                backend=args.backend,
                client=args.client,
                receivers=args.receivers,
                size_bytes=args.size,
                num_tensors=args.tensors,
                dtype=args.dtype,
                rounds=args.rounds,
                buffer_sizes=args.buffer_size,
                baselines=args.baselines,
                device=args.device,
                transactional=args.transactional,
                staged=args.staged,
                torch_threads=args.torch_threads,
                timeout_s=args.timeout,
                corrupt_round=args.corrupt_round,
                engine_options=engine_options,
                interleave=args.interleave,
            )
        )
    print_table(record, sys.stdout)
    if args.json:
        write_json(record, args.json)
    if args.plot:
        write_plot(record, args.plot)
    return 0 if record["ok"] else 1


def _engine_options(items: Sequence[str]) -> dict[str, Any]:
    """``--engine-option FIELD=VALUE`` pairs; VALUE is JSON when it parses, else a string."""
    import json

    from wtcore.errors import PayloadError

    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise PayloadError(f"--engine-option: expected FIELD=VALUE, got {item!r}")
        try:
            out[name.strip()] = json.loads(text)
        except ValueError:
            out[name.strip()] = text
    return out


def _bench_on_nodes(args: argparse.Namespace) -> dict[str, Any]:
    """The same bench, run again inside the trainer's node of a namespaced cluster."""
    from wtcore_bench.nodes import run_on_nodes

    inner = [
        "--backend", args.backend, "--client", args.client,
        "--receivers", str(args.receivers), "--size", str(args.size),
        "--tensors", str(args.tensors), "--dtype", args.dtype, "--rounds", str(args.rounds),
        "--baselines", "none", "--torch-threads", str(args.torch_threads),
        "--timeout", str(args.timeout),
        *(["--buffer-size", ",".join(map(str, args.buffer_size))] if args.buffer_size else []),
        *(["--transactional"] if args.transactional else []),
        *(["--staged"] if args.staged else []),
        *(a for item in args.engine_option for a in ("--engine-option", item)),
    ]  # fmt: skip
    return run_on_nodes(
        inner,
        client=args.client,
        nodes=args.nodes,
        receivers=args.receivers,
        link_rate=args.link_rate,
        timeout_s=args.timeout,
        rounds=args.rounds,
    )


def _cmd_bench_delta(args: argparse.Namespace) -> int:
    from wtcore_bench.delta import DeltaBenchOptions, print_delta_table, run_delta_bench

    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    opts = DeltaBenchOptions(
        backend=args.backend,
        receivers=args.receivers,
        steps=args.delta_steps,
        width=args.delta_width,
        timeout_s=args.timeout,
        mode=args.delta_mode,
    )
    return _report(run_delta_bench(opts), print_delta_table, args.json)


def _cmd_bench_sharded(args: argparse.Namespace) -> int:
    from wtcore_bench.sharded import ShardedBenchOptions, print_sharded_table, run_sharded_bench

    m, n = args.trainer_ranks, args.receivers
    if m < 1:
        return _usage("--trainer-ranks must be at least 1")
    if args.nodes and args.nodes != m + 2 * n:
        return _usage(
            "--nodes with --trainer-ranks puts every trainer rank and every receiver of both "
            f"fleets on a node of its own: {m} + 2 x {n} = {m + 2 * n}"
        )
    if args.link_rate is not None and not args.nodes:
        return _usage("--link-rate needs --nodes")
    opts = ShardedBenchOptions(
        backend=args.backend,
        trainer_ranks=m,
        receivers=n,
        layout=args.layout,
        size_bytes=args.size,
        num_tensors=args.tensors,
        dtype=args.dtype,
        rounds=args.rounds,
        buffer_size_bytes=args.buffer_size[0] if args.buffer_size else 16 << 20,
        nodes=bool(args.nodes),
        link_rate=args.link_rate,
        timeout_s=args.timeout,
    )
    return _report(run_sharded_bench(opts), print_sharded_table, args.json)


def _report(record: dict[str, Any], table: Any, json_path: str | None) -> int:
    """Print ``record``'s table, write it as JSON if asked; the exit status it deserves."""
    from wtcore_bench.report import write_json

    table(record, sys.stdout)
    if json_path:
        write_json(record, json_path)
    return 0 if record["ok"] else 1
