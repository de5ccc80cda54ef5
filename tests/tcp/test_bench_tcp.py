"""``wtcore bench --backend tcp``: its peer (pyzmq) is a yardstick only if it moves the model
exactly, and the engine runs in the bench against nccl's limits, verified.

Real processes: the peer's receivers are spawned, and its digests are checked against the
trainer's after every session (a receiver holding other bytes fails the measurement).
"""

from __future__ import annotations

import pytest
import torch

from wtcore.errors import TransferError
from wtcore_bench import BaselineContext
from wtcore_bench.support import tcp as tcp_bench
from wtcore_bench.support.nccl import raw_gloo_session
from wtcore_kit.synthetic import synthetic_state

pytestmark = pytest.mark.timeout(240)


def _ctx(receivers: int) -> BaselineContext:
    state = synthetic_state(2 << 20, 30, "bfloat16", seed=3)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return BaselineContext(state, nbytes, receivers, timeout_s=120)


def test_the_zmq_peer_moves_the_model_bit_exact_to_every_receiver() -> None:
    ctx = _ctx(receivers=2)
    with tcp_bench.zmq_session(ctx) as one_round:
        for _ in range(2):
            one_round()
    # the session's exit compared every receiver's digests with the trainer's (no raise)


def test_the_zmq_peer_fails_when_a_receiver_holds_other_bytes() -> None:
    ctx = _ctx(receivers=1)
    with pytest.raises(TransferError, match="zmq peer"), tcp_bench.zmq_session(ctx) as one_round:
        one_round()
        first = next(iter(ctx.state.values()))
        with torch.no_grad():
            first.add_(1)  # the receivers keep the first round's bytes


def test_the_bench_declares_one_yardstick_with_nccl_and_the_peer_in_turns() -> None:
    baselines = tcp_bench.BENCH.baselines
    assert baselines["raw_gloo"].session is raw_gloo_session
    assert baselines["zmq"].peer is True and baselines["zmq"].session is tcp_bench.zmq_session
    assert [n for n, b in baselines.items() if b.peer] == ["zmq"]
