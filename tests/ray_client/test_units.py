"""The parts that need no Ray cluster: the actor class as a plain object, payload checks."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from wtcore import PayloadError, ProtocolStateError, TensorSource
from wtcore.digest import digest_named
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink
from wtcore.testing import build_module, mixed_dtype_state, zeros_like_state
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_ray_client import RayWeightSyncClient, ReceiverFleet, WeightSyncActor
from wtcore_ray_client._json import check_json_safe


@pytest.mark.processes
def test_import_does_not_import_ray() -> None:
    code = "import sys, wtcore_ray_client; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("module", ["wtcore_ray_client", "wtcore_ray_client.launch"])
def test_receiver_group_is_the_old_name_of_receiver_fleet(module: str) -> None:
    """A set of receivers is a fleet (as in the bench); ``ReceiverGroup`` forwards until 0.3."""
    mod = importlib.import_module(module)
    with pytest.warns(
        DeprecationWarning, match=rf"{module}\.ReceiverGroup is renamed ReceiverFleet"
    ):
        old = mod.ReceiverGroup
    assert old is ReceiverFleet
    assert "ReceiverGroup" not in mod.__all__ and "ReceiverFleet" in mod.__all__
    with pytest.raises(AttributeError, match="has no attribute 'ReceiverGang'"):
        mod.ReceiverGang  # noqa: B018


def test_actor_class_serves_the_core_worker_without_ray() -> None:
    """The same class a Ray actor runs, driven directly: a full round, state rules intact."""
    state = mixed_dtype_state(seed=9)
    module = build_module(zeros_like_state(state))
    actor = WeightSyncActor("inline", lambda: ModuleSink(module))
    with pytest.raises(ProtocolStateError, match="call init_weight_transfer_engine first"):
        actor.start_weight_update()
    info = InlineTrainerInitInfo(packed_buffer_size_bytes=1 << 20, rank=0)
    with WeightTransferTrainerFactory.trainer_init(info, client=actor) as trainer:
        trainer.send_weights(TensorSource(state), weight_version="v1")
    assert actor.weight_info()["weight_version"] == "v1"
    assert actor.checksums() == digest_named(state.items())
    for name, t in state.items():
        assert torch.equal(dict(module.named_parameters())[name], t)
    ident = actor.identity()
    assert ident["rank"] == 0 and ident["backend"] == "inline"
    actor.shutdown_weight_sync()
    assert actor.weight_info()["state"] == "closed"


def test_mixin_must_be_set_up_and_only_once() -> None:
    class Inference(WeightSyncActor):
        def __init__(self) -> None:  # does not call setup_weight_sync yet
            self.model = build_module(zeros_like_state(mixed_dtype_state(seed=1)))

    actor = Inference()
    with pytest.raises(ProtocolStateError, match=r"call setup_weight_sync\(config, sink"):
        actor.weight_info()
    actor.setup_weight_sync("inline", lambda: ModuleSink(actor.model), rank=1, world_size=2)
    assert actor.weight_info()["rank"] == 1
    with pytest.raises(ProtocolStateError, match="already set up"):
        actor.setup_weight_sync("inline", lambda: ModuleSink(actor.model))


def test_sink_factory_must_return_a_sink() -> None:
    with pytest.raises(PayloadError, match="returned dict, which has no load_weights"):
        WeightSyncActor("inline", lambda: {})
    with pytest.raises(PayloadError, match="expected a WeightSink or a zero-argument callable"):
        WeightSyncActor("inline", 42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"a": torch.zeros(1)}, r"init_info\['a'\]: expected a JSON value .* torch\.Tensor"),
        ({"a": [1, {"b": object()}]}, r"init_info\['a'\]\[1\]\['b'\]: .*builtins\.object"),
        ({1: "x"}, r"init_info: keys must be strings \(JSON\), got int 1"),
        ({"a": b"raw"}, r"init_info\['a'\]: .*builtins\.bytes"),
    ],
)
def test_non_json_payloads_are_refused(payload: Any, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        check_json_safe(payload, "init_info")


def test_json_payloads_pass() -> None:
    check_json_safe(
        {"names": ["a"], "shapes": [[1, 2], (3,)], "x": None, "f": 1.5, "ok": True}, "update_info"
    )


def test_client_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="needs at least one actor"):
        RayWeightSyncClient([])
    with pytest.raises(PayloadError, match=r"handles\[0\]: expected a Ray actor handle"):
        RayWeightSyncClient([object()])  # type: ignore[list-item]


def test_the_actor_answers_vllm_weight_checker_and_version_routes() -> None:
    state = mixed_dtype_state(seed=4)
    module = build_module(zeros_like_state(state))
    actor = WeightSyncActor("inline", lambda: ModuleSink(module))
    info = InlineTrainerInitInfo(packed_buffer_size_bytes=1 << 20, rank=0)
    with WeightTransferTrainerFactory.trainer_init(info, client=actor) as trainer:
        trainer.send_weights(TensorSource(state), weight_version="v1")
    baseline = actor.weight_checker("checksum")["checksums"]
    assert baseline == digest_named(state.items())
    assert actor.weight_checker("reset") == {"status": "reset"}
    assert actor.weight_info()["consistent"] is False
    answer = actor.weight_checker("compare", baseline)
    assert answer["match"] is False and answer["mismatches"] == sorted(
        n for n, t in state.items() if bool(t.any())
    )
    actor.update_weight_version("v1-relabelled")
    assert actor.weight_info()["weight_version"] == "v1-relabelled"
    actor.shutdown_weight_sync()
