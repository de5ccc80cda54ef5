"""The ``vllm_packing`` peer of ``wtcore bench --baselines peers``: real processes, real gloo.

It is a yardstick only if it moves the model exactly: every receiver's final model must equal
the trainer's, tensor by tensor, and a receiver holding other bytes must fail the measurement.
"""

from __future__ import annotations

import pytest
import torch

from wtcore_bench import BaselineContext
from wtcore_bench.support.nccl import BENCH, vllm_buckets, vllm_packing_run
from wtcore_kit.synthetic import synthetic_state

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


def _ctx(receivers: int) -> BaselineContext:
    state = synthetic_state(2 << 20, 30, "bfloat16", seed=3)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return BaselineContext(state, nbytes, receivers, timeout_s=120)


def test_bucket_rule_closes_a_bucket_once_it_exceeds_the_target() -> None:
    assert vllm_buckets([4, 4, 4, 4, 4], 8) == [(0, 3), (3, 5)]
    assert vllm_buckets([100, 1], 8) == [(0, 1), (1, 2)]
    assert vllm_buckets([], 8) == []


def test_vllm_packing_moves_the_model_bit_exact_to_every_receiver() -> None:
    ctx = _ctx(receivers=2)
    gbps, models = vllm_packing_run(ctx, repeats=1, target_bytes=256 << 10, send_models=True)
    assert gbps > 0
    assert len(models) == 2
    for model in models:
        assert list(model) == list(ctx.state)
        for name, want in ctx.state.items():
            assert model[name].dtype == want.dtype and torch.equal(model[name], want), name


def test_vllm_packing_is_a_peer_on_cpu_and_cuda() -> None:
    peer = BENCH.baselines["vllm_packing"]
    assert peer.peer is True and set(peer.devices) == {"cpu", "cuda"}
    assert not any(b.peer for n, b in BENCH.baselines.items() if n != "vllm_packing")


def test_raw_gloo_session_broadcasts_once_per_call_and_checks_every_receiver() -> None:
    import multiprocessing as mp

    from wtcore_bench.limits import session_gbps
    from wtcore_bench.support.nccl import raw_gloo_session

    raw = BENCH.baselines["raw_gloo"]
    assert raw.session is raw_gloo_session  # so `wtcore bench --interleave` can take turns
    ctx = _ctx(receivers=2)
    with raw_gloo_session(ctx) as broadcast:
        for _ in range(3):
            broadcast()
        # the receivers stay up between calls, with no receive posted
        assert len([p for p in mp.active_children() if p.is_alive()]) == 2
    # on exit each receiver reported 3 broadcasts and the sender's bytes, and was stopped
    assert [p for p in mp.active_children() if p.is_alive()] == []
    assert session_gbps(raw_gloo_session, ctx, repeats=2) > 0


def test_per_tensor_session_runs_round_after_round_and_stops_its_receivers() -> None:
    import multiprocessing as mp

    from wtcore_bench.support.nccl import per_tensor_session

    assert BENCH.baselines["per_tensor"].session is per_tensor_session
    with per_tensor_session(_ctx(receivers=1)) as run:
        for _ in range(3):
            run()  # 30 control calls and broadcasts each, answered by the same receiver
        assert len([p for p in mp.active_children() if p.is_alive()]) == 1
    assert [p for p in mp.active_children() if p.is_alive()] == []
