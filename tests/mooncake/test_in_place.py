"""The mooncake worker reads a large tensor straight into the sink's own tensor (slots' path).

Real transfer engines (TCP on loopback), a real module sink: rounds that mix in-place tensors
(at least ``direct_min_bytes``, a bucket each) and packed ones are bit-exact, the in-place
bytes land in the very storage of the module's parameters (registered only while their read
runs: none is left registered after a round), and the sink's current tensors are the ones read
into, after a re-init or a replaced tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import TransferError
from wtcore.meta import ParamMeta, metas_to_wire
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inproc import InProcessClient
from wtcore_mooncake import MooncakeTrainerInitInfo

pytestmark = [pytest.mark.timeout(120)]

DIRECT = 4096
BIG = ("big.weight", "other.weight")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # the first bucket of a round is loaded through staging whatever its size (the worker's
    # sink chain offers in place only once a round's first batch says it is no delta round)
    return {
        "small.bias": torch.randn(10, generator=g),  # packed
        "big.weight": torch.randn(64, 32, generator=g),  # 8 KiB: in place
        "other.weight": torch.randn(2048, generator=g).to(torch.bfloat16),  # 4 KiB: in place
        "tiny": torch.randn(3, 3, generator=g),  # packed
    }


def _pair(
    state: dict[str, torch.Tensor], **options: Any
) -> tuple[WeightSyncWorker, Any, torch.nn.Module, dict[str, torch.Tensor]]:
    model = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    source_state = {k: v.clone() for k, v in state.items()}
    # the slots' path (test_source_reads has the other): packed buckets, large tensors alone
    options = {
        "packed_buffer_size_bytes": 2048,
        "direct_min_bytes": DIRECT,
        "source_reads": False,
        **options,
    }
    info = MooncakeTrainerInitInfo(timeout_s=30, rank=0, **options)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=InProcessClient(worker, timeout_s=30), source=TensorSource(source_state)
    )
    return worker, trainer, model, source_state


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


def _registered(worker: WeightSyncWorker, model: torch.nn.Module) -> list[str]:
    """The parameters registered with the worker's transfer engine: Mooncake refuses to
    register memory that overlaps registered memory (what it accepts is unregistered again)."""
    engine = worker.engine._engine  # type: ignore[attr-defined]
    held = []
    for name, p in _params(model).items():
        if engine.register_memory(p.data_ptr(), p.nbytes) == 0:
            engine.unregister_memory(p.data_ptr())
        else:
            held.append(name)
    return held


def test_mixed_rounds_are_bit_exact_and_large_tensors_land_in_the_sinks_storage() -> None:
    state = _state(1)
    worker, trainer, model, source_state = _pair(state)
    try:
        params = _params(model)
        ptrs = {k: params[k].data_ptr() for k in params}
        for round_ in range(3):
            fresh = _state(10 + round_)
            for k, v in fresh.items():
                source_state[k].copy_(v)
            trainer.send_weights(weight_version=f"v{round_}")
            assert_state_equal(model, fresh)
            # the parameters were not replaced: the same storage received the bytes
            assert {k: v.data_ptr() for k, v in _params(model).items()} == ptrs
        engine = worker.engine
        direct_nbytes = sum(state[k].numel() * state[k].element_size() for k in BIG)
        packed_payload = sum(
            state[k].numel() * state[k].element_size() for k in state if k not in BIG
        )
        assert engine.in_place_bytes == 3 * direct_nbytes
        assert 3 * packed_payload <= engine.staged_bytes < 3 * (packed_payload + 4 * 64)
        assert _registered(worker, model) == []  # only while their reads ran
    finally:
        trainer.shutdown()
        worker.shutdown()


def test_direct_min_bytes_zero_reads_everything_through_staging() -> None:
    state = _state(2)
    worker, trainer, model, _ = _pair(state, direct_min_bytes=0)
    try:
        trainer.send_weights(weight_version="v1")
        assert_state_equal(model, state)
        assert worker.engine.in_place_bytes == 0
        assert _registered(worker, model) == []
    finally:
        trainer.shutdown()
        worker.shutdown()


def test_a_sink_that_replaces_its_tensors_gets_the_new_ones_read_in_place() -> None:
    state = _state(5)
    worker, trainer, model, source_state = _pair(state)
    try:
        for round_ in range(3):
            for k in BIG:  # the sink's tensors change between rounds, without a re-init
                p = model.get_parameter(k)
                p.data = torch.zeros_like(p.data)
            fresh = _state(20 + round_)
            for k, v in fresh.items():
                source_state[k].copy_(v)
            trainer.send_weights(weight_version=f"v{round_}")
            assert_state_equal(model, fresh)
            assert _registered(worker, model) == []
        assert worker.engine.in_place_bytes == 3 * sum(state[k].nbytes for k in BIG)
    finally:
        trainer.shutdown()
        worker.shutdown()


def test_a_re_init_registers_the_sinks_new_tensors() -> None:
    state = _state(3)
    worker, trainer, model, source_state = _pair(state)
    try:
        trainer.send_weights(weight_version="v1")
        assert_state_equal(model, state)
        # the sink's tensors change (new storage), then the trainer handshakes again
        sink = ModuleSink(model)
        for k in BIG:
            p = model.get_parameter(k)
            p.data = torch.zeros_like(p.data)
        assert sink is not None
        trainer.handshake()
        fresh = _state(4)
        for k, v in fresh.items():
            source_state[k].copy_(v)
        trainer.send_weights(weight_version="v2")
        assert_state_equal(model, fresh)
        assert _registered(worker, model) == []
        assert worker.engine.in_place_bytes == sum(fresh[k].nbytes for k in BIG)
    finally:
        trainer.shutdown()
        worker.shutdown()


def test_a_failed_read_unregisters_the_sinks_tensors() -> None:
    state = _state(6)
    worker, trainer, model, _ = _pair(state)
    try:
        trainer.send_weights(weight_version="v1")
        assert worker.engine.in_place_bytes > 0
        metas = [ParamMeta("small.bias", torch.float32, (10,))]
        trainer.shutdown()  # its staging is unregistered: the read below finds nothing there
        worker.start_weight_update()
        with pytest.raises(TransferError, match="failed"):
            worker.update_weights({**metas_to_wire(metas), "slot": 0, "nbytes": 40})
        assert _registered(worker, model) == []
        assert worker.engine._staging is None
    finally:
        trainer.shutdown()
        worker.shutdown()
