"""Sources check iteration against metadata; ModuleSink validates a batch before writing."""

from __future__ import annotations

import pytest
import torch

from wtcore import ModuleSink, ModuleSource, PayloadError, TensorSource
from wtcore.meta import materialize_full_tensor
from wtcore.source import iter_checked
from wtcore.testing import MISMATCH_KINDS, MismatchedSource, build_module, mixed_dtype_state


def test_module_source_metadata_matches_iteration() -> None:
    state = mixed_dtype_state()
    src = ModuleSource(build_module(state))
    metas = src.metadata()
    assert [m.name for m in metas] == list(state)
    pairs = list(iter_checked(src))
    assert [m for m, _ in pairs] == metas
    for (meta, t), want in zip(pairs, state.values(), strict=True):
        assert torch.equal(t, want), meta.name


def test_iter_checked_makes_contiguous() -> None:
    base = torch.arange(6.0).reshape(2, 3)
    [(meta, t)] = list(iter_checked(TensorSource({"w": base.t()})))
    assert t.is_contiguous() and meta.shape == (3, 2)
    assert torch.equal(t, base.t())


@pytest.mark.parametrize("kind", MISMATCH_KINDS)
def test_iter_checked_rejects_every_mismatch(kind: str) -> None:
    src = MismatchedSource(TensorSource(mixed_dtype_state()), kind)
    with pytest.raises(PayloadError, match="metadata") as exc:
        list(iter_checked(src))
    text = str(exc.value)
    assert any(w in text for w in ("does not match", "extra tensor", "stopped after")), text


def test_materialize_full_tensor_plain_tensor_is_identity() -> None:
    t = torch.ones(3)
    assert materialize_full_tensor(t) is t


def _module() -> torch.nn.Module:
    return build_module({"a.w": torch.zeros(2, 2), "b.w": torch.zeros(3, dtype=torch.bfloat16)})


def test_module_sink_loads_by_name() -> None:
    m = _module()
    ModuleSink(m).load_weights([("a.w", torch.ones(2, 2))])
    assert torch.equal(dict(m.named_parameters())["a.w"], torch.ones(2, 2))


def test_module_sink_reports_every_problem_and_applies_nothing() -> None:
    m = _module()
    batch = [
        ("a.w", torch.full((2, 2), 7.0)),  # fine, but must not be applied
        ("nope.w", torch.zeros(1)),
        ("b.w", torch.zeros(4, dtype=torch.bfloat16)),
        ("a.w", torch.zeros(2, 2, dtype=torch.float64)),
    ]
    with pytest.raises(PayloadError) as exc:
        ModuleSink(m).load_weights(batch)
    text = str(exc.value)
    assert "rejected 3 of 4" in text
    assert "'nope.w': unknown parameter name" in text
    assert "'b.w': shape mismatch, expected [3], got [4]" in text
    assert "'a.w': dtype mismatch, expected float32, got float64" in text
    assert torch.equal(dict(m.named_parameters())["a.w"], torch.zeros(2, 2))


def test_module_sink_includes_buffers() -> None:
    m = _module()
    m.register_buffer("running", torch.zeros(2))
    ModuleSink(m).load_weights([("running", torch.ones(2))])
    assert torch.equal(m.running, torch.ones(2))


def test_a_sharded_source_is_refused_by_an_engine_that_does_not_execute_plans() -> None:
    """Without a process group a ShardedModuleSource is one rank holding everything. An engine
    that does not execute plans says so before the round starts (nothing applied); inline,
    which does, sends it bit-exact."""
    from wtcore import WeightSyncWorker
    from wtcore.sharded import ShardedModuleSource
    from wtcore.sharded.layout import Layout
    from wtcore_kit.inline import InlineTrainerEngine, InlineTrainerInitInfo
    from wtcore_kit.inproc import InProcessClient

    class NoPlans(InlineTrainerEngine):
        executes_plans = False

    model = torch.nn.Linear(3, 2)
    src = ShardedModuleSource(model)
    assert (src.rank, src.world_size) == (0, 1)
    assert src.layouts() == {
        "weight": Layout.whole((2, 3)),
        "bias": Layout.whole((2,)),
    }
    assert [(n, t.data_ptr()) for n, t in src] == [
        (n, p.data_ptr()) for n, p in model.named_parameters()
    ]
    target = build_module({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    worker = WeightSyncWorker("inline", ModuleSink(target))
    refusing = NoPlans.trainer_init(InlineTrainerInitInfo(rank=0), client=InProcessClient(worker))
    trainer = InlineTrainerEngine.trainer_init(
        InlineTrainerInitInfo(rank=0), client=InProcessClient(worker)
    )
    try:
        with pytest.raises(PayloadError, match="the inline engine does not execute sharded plans"):
            refusing.send_weights(src, weight_version="v1")
        assert worker.weight_info()["weight_version"] is None
        assert worker.weight_info()["state"] == "idle"
        refusing.send_weights(ModuleSource(model), weight_version="v0")  # gathering still works
        assert torch.equal(target.weight, model.weight.detach())
        with torch.no_grad():
            target.weight.zero_()
        trainer.send_weights(src, weight_version="v1")  # a plan of one rank, executed
        assert torch.equal(target.weight, model.weight.detach())
        assert worker.weight_info()["weight_version"] == "v1"
    finally:
        refusing.shutdown()
        trainer.shutdown()
        worker.shutdown()
