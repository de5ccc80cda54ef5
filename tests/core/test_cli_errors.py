"""Any WtcoreError a command raises is one line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wtcore import hooks
from wtcore.cli import main
from wtcore.errors import ReceiverError, ReceiverFailure, TransferTimeoutError
from wtcore.hookspecs import hookimpl

WTCORE = [str(Path(sys.executable).with_name("wtcore"))]


class _FailingCommand:
    """A plugin command that fails the way a round can: a multi-line ReceiverError."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    @hookimpl
    def wtcore_add_commands(self, subparsers: argparse._SubParsersAction[Any]) -> None:
        p = subparsers.add_parser("explode")
        p.set_defaults(func=self.run)

    def run(self, args: argparse.Namespace) -> int:
        raise self.error


@pytest.fixture
def command_raising() -> Iterator[Any]:
    names: list[str] = []

    def add(error: BaseException) -> None:
        names.append(hooks.register_hooks(_FailingCommand(error), name="test-explode"))

    yield add
    for name in names:
        hooks.unregister_hooks(name=name)


def test_a_receiver_error_is_one_line(command_raising: Any, capsys: Any) -> None:
    failures = [
        ReceiverFailure("http://a:8000", "POST /update_weights: bad", 400, "PayloadError"),
        ReceiverFailure("http://b:8000", "no answer within 3 s", None, "TransferTimeoutError"),
    ]
    command_raising(ReceiverError("update_weights", failures, total=2))
    assert main(["explode"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    (line,) = out.err.splitlines()
    assert line.startswith("wtcore: error: ReceiverError: update_weights failed on 2 of 2")
    assert "http://a:8000 [400]: PayloadError: POST /update_weights: bad" in line
    assert "http://b:8000: TransferTimeoutError: no answer within 3 s" in line


def test_a_timeout_is_one_line(command_raising: Any, capsys: Any) -> None:
    command_raising(TransferTimeoutError("rendezvous: no peer within 5 s"))
    assert main(["explode"]) == 1
    assert capsys.readouterr().err == (
        "wtcore: error: TransferTimeoutError: rendezvous: no peer within 5 s\n"
    )


def test_other_exceptions_still_show_a_traceback(command_raising: Any) -> None:
    command_raising(ZeroDivisionError("a bug"))  # a bug is not the user's to fix: keep the trace
    with pytest.raises(ZeroDivisionError):
        main(["explode"])


@pytest.mark.processes
def test_console_script_unknown_backend_is_one_line() -> None:
    out = subprocess.run(
        [*WTCORE, "bench", "--backend", "no-such-engine", "--receivers", "1", "--size", "4KiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    last = out.stderr.replace("\r", "\n").splitlines()[-1]
    assert last.startswith(
        "wtcore: error: PluginLoadError: unknown trainer engine 'no-such-engine'"
    )
