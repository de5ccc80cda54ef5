"""``--baselines peers|all`` and ``--device``: which baselines run, and the one-line refusals.

The selection is checked against the plugins installed here (nccl declares the vLLM-packing
peer, tcp the pyzmq peer, the Ray client the object-store peer); measuring them is tested with
each plugin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wtcore.cli import build_parser
from wtcore.errors import PayloadError
from wtcore.registry import TRAINER_ENGINES
from wtcore_bench import BenchNotSupportedError
from wtcore_bench.baselines import select_baselines
from wtcore_bench.support import engine_bench

WTCORE = str(Path(sys.executable).with_name("wtcore"))
GENERIC = {"memcpy", "file"}
PEERS = {"vllm_packing", "ray_object_store", "zmq"}


def _names(baselines: str, backend: str = "inline", device: str = "cpu") -> set[str]:
    chosen, _ = select_baselines(baselines, device, engine_bench(backend))
    return set(chosen)


def test_auto_measures_limits_only_and_peers_adds_every_installed_peer() -> None:
    assert _names("auto") == GENERIC
    assert _names("auto", "nccl") == GENERIC | {"raw_gloo", "per_tensor"}
    assert _names("peers") == GENERIC | PEERS
    assert _names("peers", "ipc") == GENERIC | {"shm_copy"} | PEERS
    assert _names("auto", "mooncake") == GENERIC | {"bare_read"}
    limits = {"raw_gloo", "per_tensor", "shm_copy", "bare_read"}
    assert _names("all") == GENERIC | limits | PEERS
    assert _names("none") == set()


def test_baselines_that_cannot_run_on_the_device_are_skipped_with_the_reason() -> None:
    chosen, skipped = select_baselines("peers", "cuda", engine_bench("nccl"))
    assert set(chosen) == {"vllm_packing"}
    assert set(skipped) == GENERIC | {"raw_gloo", "per_tensor", "ray_object_store", "zmq"}
    assert skipped["ray_object_store"] == "runs on cpu only, not --device cuda"


def test_unknown_baseline_set_names_the_field() -> None:
    with pytest.raises(PayloadError, match="baselines: expected one of auto, peers, all, none"):
        select_baselines("most", "cpu", engine_bench("inline"))


def test_the_cli_accepts_peers_all_and_device() -> None:
    for value in ("peers", "all"):
        args = build_parser().parse_args(["bench", "--baselines", value, "--device", "cuda"])
        assert args.baselines == value and args.device == "cuda"
    assert build_parser().parse_args(["bench"]).device == "cpu"


def test_an_engine_without_cuda_says_so() -> None:
    engine = TRAINER_ENGINES.load("inline")
    with pytest.raises(BenchNotSupportedError, match=r"InlineTrainerEngine .* --device cuda.*cpu"):
        engine_bench("inline").check_device(engine, "cuda")
    for name in ("nccl", "ipc"):
        engine_bench(name).check_device(TRAINER_ENGINES.load(name), "cuda:0")  # declared


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_device_cuda_without_cuda_is_one_clear_line() -> None:
    proc = subprocess.run(
        [WTCORE, "bench", "--backend", "nccl", "--device", "cuda", "--size", "1MiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--device cuda" in lines[0] and "no CUDA device" in lines[0]


def test_a_peer_whose_receiver_holds_other_bytes_fails_naming_it() -> None:
    from wtcore.digest import digest_named
    from wtcore.errors import TransferError
    from wtcore.testing import mixed_dtype_state
    from wtcore_bench.received import check_digests

    state = mixed_dtype_state(seed=4)
    want = digest_named(state.items())
    check_digests("peer", "rank 1", want, dict(want))  # identical: no error
    name = next(n for n, t in state.items() if t.numel() and t.dtype.is_floating_point)
    with torch.no_grad():
        state[name].view(-1)[:1].add_(1)
    with pytest.raises(
        TransferError, match=rf"peer: receiver rank 1 .* 1 tensor\(s\), first '{name}'"
    ):
        check_digests("peer", "rank 1", want, digest_named(state.items()))


def test_raw_bytes_round_trip_bit_exact_for_every_dtype() -> None:
    from wtcore.testing import mixed_dtype_state
    from wtcore_bench.received import raw_state, state_from_raw, state_spec

    state = mixed_dtype_state(seed=6)
    back = state_from_raw(raw_state(state.items()), state_spec(state))
    assert list(back) == list(state)
    for n, t in state.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n
