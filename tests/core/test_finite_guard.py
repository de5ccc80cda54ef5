"""``reject_nonfinite=True`` on every floating dtype, float8 included (issue 14, item 11)."""

from __future__ import annotations

import pytest
import torch

from wtcore import (
    ModuleSink,
    ReceiverError,
    TensorSource,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.finite import FiniteCheckSink
from wtcore.testing import build_module
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient

#: The float8 formats on the wire allow-list; the sink test below covers the ``fnuz`` ones too.
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ALL_FLOAT8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]


def _state(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(16, 8, generator=g).to(dtype),
        "b.weight": torch.randn(33, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_rounds_pass_and_nan_is_rejected(dtype: torch.dtype) -> None:
    good = _state(dtype, 0)
    model = build_module({k: torch.zeros_like(v) for k, v in good.items()})
    worker = WeightSyncWorker("inline", ModuleSink(model), reject_nonfinite=True)
    engine = WeightTransferTrainerFactory.trainer_init(
        InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=4096), client=InProcessClient(worker)
    )
    engine.send_weights(TensorSource(good), weight_version="v1")
    held = dict(model.named_parameters())
    assert all(torch.equal(held[k].view(torch.uint8), v.view(torch.uint8)) for k, v in good.items())
    bad = _state(dtype, 1)
    bad["b.weight"][5] = float("nan")
    with pytest.raises(
        ReceiverError, match=r"non-finite weights \(NaN or Inf\) in 1 tensor\(s\): 'b.weight'"
    ):
        engine.send_weights(TensorSource(bad), weight_version="v2")
    assert worker.weight_info()["weight_version"] == "v1"
    engine.shutdown()
    worker.shutdown()


@pytest.mark.parametrize("dtype", ALL_FLOAT8, ids=str)
def test_the_sink_checks_every_float8_format(dtype: torch.dtype) -> None:
    t = torch.zeros(7, dtype=dtype)
    sink = FiniteCheckSink(ModuleSink(build_module({"w": torch.zeros(7, dtype=dtype)})))
    sink.load_weights([("w", t)])
    t[6] = float("nan")
    with pytest.raises(ValueError, match="'w'"):
        sink.load_weights([("w", t)])


def test_float8_inf_and_large_tensors_are_checked_in_chunks() -> None:
    """e5m2 has an Inf; a tensor larger than one upcast chunk is checked to its last element."""
    sink = FiniteCheckSink(
        ModuleSink(build_module({"w": torch.zeros(3 << 20, dtype=torch.float8_e4m3fn)}))
    )
    t = torch.zeros(3 << 20, dtype=torch.float8_e4m3fn)
    t[-1] = float("nan")
    with pytest.raises(ValueError, match="'w'"):
        sink.load_weights([("w", t)])
    e5 = torch.zeros(10, dtype=torch.float8_e5m2)
    e5[3] = float("inf")
    sink5 = FiniteCheckSink(
        ModuleSink(build_module({"w": torch.zeros(10, dtype=torch.float8_e5m2)}))
    )
    with pytest.raises(ValueError, match="'w'"):
        sink5.load_weights([("w", e5)])
