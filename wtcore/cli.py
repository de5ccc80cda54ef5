"""The ``wtcore`` command line.

Built-in subcommands: ``plugins`` (what is installed and whether it runs here) and ``bench``
(the main job: receivers started, rounds verified, measured against this machine's limits).
Plugins add more through the ``wtcore_add_commands`` hook, for example ``wtcore serve`` from
wtcore-http-client.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main"]


def _size(text: str) -> int:
    from wtcore.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    from wtcore._version import __version__
    from wtcore.hooks import get_plugin_manager

    parser = argparse.ArgumentParser(
        prog="wtcore", description="Move trained weights from RL trainers into inference workers."
    )
    parser.add_argument("--version", action="version", version=f"wtcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list engines, clients and hook plugins")
    p.set_defaults(func=_cmd_plugins)

    b = sub.add_parser(
        "bench",
        help="sync a synthetic model to receivers it starts, verify, and measure against limits",
    )
    b.add_argument("--backend", default="local", help="engine name (default: local)")
    b.add_argument("--client", default="inproc", help="inproc, http, ray (default: inproc)")
    b.add_argument("--receivers", type=int, default=2, help="number of receivers (default 2)")
    b.add_argument("--size", type=_size, default=_size("64MiB"), help="model size (default 64MiB)")
    b.add_argument("--tensors", type=int, default=100, help="number of tensors (default 100)")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--rounds", type=int, default=3, help="rounds per configuration (default 3)")
    b.add_argument(
        "--buffer-size",
        default="",
        help="bucket buffer size, or a comma-separated list to sweep (default: the engine's)",
    )
    b.add_argument(
        "--baselines",
        default="auto",
        choices=["auto", "all", "none"],
        help="limits and naive baselines to measure (auto: those relevant to the backend)",
    )
    b.add_argument("--transactional", action="store_true", help="receivers stage each round")
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
    b.add_argument("--corrupt-round", type=int, default=None, help=argparse.SUPPRESS)
    b.set_defaults(func=_cmd_bench)

    get_plugin_manager().hook.wtcore_add_commands(subparsers=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; any :class:`~wtcore.errors.WtcoreError` is one line on stderr, exit 1.

    Expected failures (a bad option value, a missing optional package, a receiver that
    failed) are the user's to act on, not a bug: they get ``wtcore: error: <message>``
    without a traceback, whichever command (built-in or a plugin's) raised them.
    """
    from wtcore.errors import WtcoreError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return 2
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except WtcoreError as e:
        print(f"wtcore: error: {_error_line(e)}", file=sys.stderr)
        return 1


def _error_line(error: BaseException) -> str:
    """``error`` as one line: its class and message, with any line breaks folded."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---------------------------------------------------------------------- plugins
def _cmd_plugins(args: argparse.Namespace) -> int:
    from wtcore.hooks import get_plugin_manager, hook_load_errors, hook_plugin_origins
    from wtcore.registry import CLIENTS, ENGINES, TRAINER_ENGINES, Registry, autoload_disabled

    if autoload_disabled():
        print("plugin discovery is off (WTCORE_DISABLE_PLUGIN_AUTOLOAD is set)")
    registry: Registry[Any]
    for title, registry in (
        ("engines", ENGINES),
        ("trainer engines", TRAINER_ENGINES),
        ("clients", CLIENTS),
    ):
        print(f"{title} ({registry.group}):")
        names = registry.names()
        if not names:
            print("  (none)")
        for name in names:
            info = registry.info(name)
            print(f"  {name:<10} {info.origin:<28} {_host_status(registry, name)}")
    print("hook plugins (wtcore.hooks):")
    pm = get_plugin_manager()
    hook_names = [n for n, _ in pm.list_name_plugin() if n is not None]
    dists = hook_plugin_origins()
    for name in hook_names:
        print(f"  {name:<10} {dists.get(name, 'registered at runtime')}")
    for err in hook_load_errors():
        print(f"  BROKEN     {err}")
    if not hook_names and not hook_load_errors():
        print("  (none)")
    return 0


def _host_status(registry: Any, name: str) -> str:
    try:
        cls = registry.load(name)
    except Exception as e:
        return f"BROKEN: {e}"
    status = getattr(cls, "host_status", None)
    if not callable(status):
        return "available"
    try:
        return str(status())
    except Exception as e:
        return f"unknown ({type(e).__name__}: {e})"


# ---------------------------------------------------------------------- bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from wtcore.bench import BenchOptions, run_bench
    from wtcore.bench.report import print_table, write_json, write_plot

    if args.receivers < 1 or args.rounds < 1:
        print("wtcore bench: --receivers and --rounds must be at least 1", file=sys.stderr)
        return 2
    buffers = [_size(x) for x in args.buffer_size.split(",") if x.strip()]
    opts = BenchOptions(
        backend=args.backend,
        client=args.client,
        receivers=args.receivers,
        size_bytes=args.size,
        num_tensors=args.tensors,
        dtype=args.dtype,
        rounds=args.rounds,
        buffer_sizes=buffers,
        baselines=args.baselines,
        transactional=args.transactional,
        torch_threads=args.torch_threads,
        timeout_s=args.timeout,
        corrupt_round=args.corrupt_round,
    )
    record = run_bench(opts)
    print_table(record, sys.stdout)
    if args.json:
        write_json(record, args.json)
    if args.plot:
        write_plot(record, args.plot)
    return 0 if record["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
