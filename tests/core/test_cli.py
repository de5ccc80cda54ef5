"""The ``wtcore`` console script, run as a real subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

WTCORE = [str(Path(sys.executable).with_name("wtcore"))]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WTCORE, *args], capture_output=True, text=True, timeout=120)


def test_plugins_lists_every_registry() -> None:
    out = _run("plugins")
    assert out.returncode == 0, out.stderr
    for title in (
        "engines (wtcore.backends):",
        "trainer engines (wtcore.backends):",
        "clients (wtcore.clients):",
        "hook plugins (wtcore.hooks):",
    ):
        assert title in out.stdout
    assert re.search(r"^  inline +wtcore 0\.2\.0 +available$", out.stdout, re.M)
    assert "inproc" in out.stdout


def test_bad_size_is_a_usage_error() -> None:
    out = _run("bench", "--size", "lots")
    assert out.returncode == 2
    assert "expected a size such as 4096, 64MiB or 1GiB" in out.stderr


def test_bad_buffer_size_is_a_usage_error_too() -> None:
    out = _run("bench", "--buffer-size", "1MiB,lots")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--buffer-size: expected a size such as 4096, 64MiB or 1GiB" in out.stderr


def test_no_command_prints_help() -> None:
    out = _run()
    assert out.returncode == 2 and "plugins" in out.stdout


def test_plugins_shows_installed_plugins_with_distribution_and_host_status() -> None:
    pytest.importorskip("wtcore_nccl")
    pytest.importorskip("wtcore_http_client")
    out = _run("plugins").stdout
    assert re.search(r"^  nccl +wtcore-nccl 0\.2\.0 ", out, re.M)
    assert "CUDA not available; gloo CPU path available" in out or "CUDA available" in out
    assert re.search(r"^  http_client +wtcore-http-client 0\.2\.0$", out, re.M)  # a hook plugin
