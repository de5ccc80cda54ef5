"""The ``wtcore`` command line: ``plugins``, and what plugins add (``wtcore_add_commands``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from wtcore._version import __version__
    from wtcore.hooks import get_plugin_manager
    from wtcore.registry import FIRST_PARTY

    parser = argparse.ArgumentParser(
        prog="wtcore", description="Move trained weights from RL trainers into inference workers."
    )
    parser.add_argument("--version", action="version", version=f"wtcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "plugins",
        help="list engines, clients and hook plugins; exit 1 if any is broken or conflicting",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (schema 1)")
    p.set_defaults(func=_cmd_plugins)

    get_plugin_manager().hook.wtcore_add_commands(subparsers=sub)
    for name, dist in FIRST_PARTY["commands"].items():  # not installed: say what to install
        if name not in sub.choices:
            m = sub.add_parser(name, help=f"(not installed: pip install {dist})")
            m.set_defaults(func=_missing_command, dist=dist)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; any :class:`~wtcore.errors.WtcoreError` (the user's to act on, not a
    bug) is one line on stderr without a traceback, exit 1."""
    import warnings

    from wtcore.errors import WtcoreError

    if not sys.warnoptions:  # an old name on the command line is said (Python hides it)
        warnings.filterwarnings("default", category=DeprecationWarning, module="wtcore")
    try:
        parser = build_parser()
        known, _ = parser.parse_known_args(argv)
        if getattr(known, "func", None) is _missing_command:
            return int(known.func(known))
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


def _missing_command(args: argparse.Namespace) -> int:
    print(
        f"wtcore: '{args.command}' is provided by {args.dist}: pip install {args.dist}",
        file=sys.stderr,
    )
    return 2


def _error_line(error: BaseException) -> str:
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _cmd_plugins(args: argparse.Namespace) -> int:
    """Exit 0 only when every plugin loads and no name is claimed twice."""
    import json

    from wtcore.inventory import collect, render

    record = collect()
    if args.json:
        text = json.dumps(record, indent=2) + "\n"
    else:
        text = "".join(line + "\n" for line in render(record))
    _write_stdout(text)
    if not record["ok"]:
        print("wtcore plugins: some plugins are broken or conflicting", file=sys.stderr)
    return 0 if record["ok"] else 1


def _write_stdout(text: str) -> None:
    """Write ``text``; a reader that left early (``wtcore plugins | head -1``) is no error."""
    import os

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # stdout to /dev/null, so the interpreter's final flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
