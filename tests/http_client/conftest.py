"""Real receiver server processes on 127.0.0.1, always stopped by PID."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from wtcore_bench.serve import ServeProcess, launch_serve

ServerProc = ServeProcess  # the tests' name for it


def _launch(args: list[str], tmp: Path, *, via_cli: bool) -> ServerProc:
    return launch_serve(args, workdir=tmp, via_cli=via_cli)


@pytest.fixture(scope="module")
def start_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProc]]:
    """``start_server(*args, via_cli=False)`` starts a receiver; all are stopped at the end."""
    tmp = tmp_path_factory.mktemp("servers")
    started: list[ServerProc] = []

    def start(*args: str, via_cli: bool = False) -> ServerProc:
        server = _launch(list(args), tmp, via_cli=via_cli)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop(timeout_s=10)
