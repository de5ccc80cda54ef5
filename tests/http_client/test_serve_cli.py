"""``wtcore serve``: contributed through the CLI hook, hosts a model, stops cleanly on signals."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import ReceiverError
from wtcore.digest import digest_named
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_http_client.safetensors import save_safetensors

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]


def test_serve_is_a_wtcore_subcommand() -> None:
    from wtcore.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "0", "--size", "1MiB"])
    assert args.command == "serve" and args.size == 1 << 20 and args.host == "127.0.0.1"
    assert args.func.__module__ == "wtcore_http_client.commands"


def test_refuses_a_public_bind_without_a_key() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wtcore.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2
    assert "refusing to bind '0.0.0.0' without an API key" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serves_a_safetensors_model_and_stops_on_signal(
    start_server: Any, tmp_path: Path, sig: int
) -> None:
    state = {
        **synthetic_state(32 << 10, 12, "bfloat16", seed=9),
        "extra.mask": torch.tensor([True, False, True]),
    }
    path = tmp_path / "m.safetensors"
    save_safetensors(state, path)
    server = start_server("--safetensors", str(path), "--api-key", "k", via_cli=True)
    assert server.url.startswith("http://127.0.0.1:")
    with HTTPWeightSyncClient(server.url, api_key="k", timeout_s=30) as client:
        assert client.checksums() == [digest_named(state.items())]
        assert client.weight_info()[0]["backend"] == "inline"
    with HTTPWeightSyncClient(server.url, timeout_s=30) as anonymous, pytest.raises(ReceiverError):
        anonymous.checksums()
    assert server.stop(sig) == 0, server.output()
    out = server.stdout.read_text().splitlines()
    assert out[0] == f"wtcore serve: listening on {server.url}"
    assert "auth=on" in out[1]
    assert out[-1] == "wtcore serve: stopped"
    assert "Traceback" not in server.stderr.read_text()


def test_synthetic_model_of_a_given_size_and_seed(start_server: Any) -> None:
    server = start_server("--size", "48KiB", "--tensors", "12", "--seed", "4", "--dtype", "float16")
    want = digest_named(synthetic_state(48 << 10, 12, "float16", seed=4).items())
    with HTTPWeightSyncClient(server.url, timeout_s=30) as client:
        assert client.checksums() == [want]
    assert server.stop(signal.SIGTERM) == 0, server.output()


def test_the_old_engine_name_serves_the_inline_engine_and_says_so(start_server: Any) -> None:
    """``--backend local`` (renamed ``inline`` in 0.2.0) works until 0.3, with one warning."""
    server = start_server("--size", "16KiB", "--tensors", "4", "--backend", "local", via_cli=True)
    with HTTPWeightSyncClient(server.url, timeout_s=30) as client:
        assert client.weight_info()[0]["backend"] == "inline"
    assert server.stop(signal.SIGTERM) == 0, server.output()
    assert "backend=inline" in server.stdout.read_text()
    assert server.stderr.read_text().count("engine 'local' was renamed 'inline'") == 1
