"""``wtcore serve --tp-rank R --tp-size N --tp-rules RULES`` hosts a TP slice: two real serve
processes on loopback report their layouts and receive one sharded round over ``tcp``, each
exactly its slice; a bad option value is refused before anything starts, naming the option."""

from __future__ import annotations

import argparse
import signal
from typing import Any

import pytest

from wtcore import WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.sharded import ShardedModuleSource, TPLayout
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_http_client.commands import TP_PRESETS, add_serve_arguments, run_serve
from wtcore_kit.synthetic import build_module


def _args(*options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--port", "0", "--size", "16KiB", "--tensors", "12", *options])


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        (["--tp-size", "2", "--tp-rank", "2"], "--tp-rank: expected 0 to 1, got 2"),
        (["--tp-size", "2"], "--tp-rank: expected 0 to 1, got None"),
        (["--tp-size", "0", "--tp-rank", "0"], "--tp-size: expected 1 to 65536, got 0"),
        (["--tp-rules", "llama"], "--tp-rank and --tp-rules need --tp-size"),
        (
            ["--tp-size", "2", "--tp-rank", "0", "--tp-rules", "0.*=column"],  # not llama names
            "--tp-rules: no rule splits a tensor of the model (model.embed_tokens.weight",
        ),
    ],
)
def test_a_bad_tp_option_is_refused_naming_it(
    options: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_serve(_args(*options)) == 2
    assert f"wtcore serve: error: {complaint}" in capsys.readouterr().err


def test_tp_rules_take_presets_and_overrides_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    rules = _args("--tp-rules", "lm_head.weight=replicated,llama,*.bias=row").tp_rules
    assert rules == (("lm_head.weight", "replicated"), *TP_PRESETS["llama"], ("*.bias", "row"))
    assert TPLayout(0, 2, rules).kind("lm_head.weight") == "replicated"  # the first match wins
    with pytest.raises(SystemExit):
        _args("--tp-rules", "0.*=diagonal")
    assert "argument --tp-rules: '0.*=diagonal' is neither a preset (llama)" in (
        capsys.readouterr().err
    )


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_two_tp_slices_served_by_wtcore_serve_get_exactly_their_slices(start_server: Any) -> None:
    pytest.importorskip("wtcore_tcp")
    from wtcore_tcp import TCPTrainerInitInfo

    model = ["--size", "64KiB", "--tensors", "12", "--seed", "0"]
    tp = ["--backend", "tcp", "--world-size", "2", "--tp-size", "2"]
    servers = [
        start_server(*model, *tp, "--rank", str(r), "--tp-rank", str(r), via_cli=True)
        for r in range(2)
    ]
    layouts = [TPLayout(r, 2, TP_PRESETS["llama"]) for r in range(2)]  # the default rules
    full = synthetic_state(64 << 10, 12, seed=1)  # not what the servers hold (seed 0)
    with HTTPWeightSyncClient([s.url for s in servers], timeout_s=60) as client:
        assert [i["layout"] for i in client.weight_info()] == [lay.to_wire() for lay in layouts]
        info = TCPTrainerInitInfo(address="127.0.0.1", world_size=3, rank=0, timeout_s=60)
        with WeightTransferTrainerFactory.trainer_init(info, client=client) as engine:
            source = ShardedModuleSource(build_module(full))
            stats = engine.send_weights(source, weight_version="step-1")
        slices = [{n: lay.local(n, t) for n, t in full.items()} for lay in layouts]
        assert client.checksums() == [digest_named(s.items()) for s in slices]
        for i, held in zip(client.weight_info(), slices, strict=True):
            nbytes = sum(t.nbytes for t in held.values())
            assert i["weight_version"] == "step-1" and i["consistent"], i
            assert i["round_bytes"] == {"planned": nbytes, "landed": nbytes}, i
        assert stats.bytes_sent == sum(t.nbytes for s in slices for t in s.values())
    for r, server in enumerate(servers):
        assert server.stop(signal.SIGTERM) == 0, server.output()
        assert f"backend=tcp rank={r}/2 tp={r}/2 tensors=12 " in server.stdout.read_text()
