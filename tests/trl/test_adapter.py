"""wtcore-trl without TRL's trainer: the source over TRL's iterator, and the install checks.

The round itself runs on wtcore's ``nccl`` engine over a real gloo group (the worker on a
thread of this process), with large tensors sent in place: the engine may read a tensor after
the iterator has moved on, which is exactly when DeepSpeed ZeRO-3 or FSDP1 re-shard a gathered
parameter. The iterator here overwrites every tensor it yielded as soon as it is resumed, as a
re-shard would; the receiver must still hold the weights bit for bit. The GRPOTrainer itself
runs against a real vLLM server in ``tests/vllm/test_trl_grpo.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.nccl.nccl_e2e_kit import loopback_info
from wtcore import ModuleSink, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import PayloadError, PluginLoadError, ProtocolStateError
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inproc import InProcessClient
from wtcore_trl.source import StreamSource

pytestmark = [pytest.mark.timeout(120)]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(64, 40, generator=g),  # 10 KiB: in place
        "norm.weight": torch.randn(40, generator=g),
        "head.weight": torch.randn(40, 64, generator=g).to(torch.bfloat16),  # 5 KiB: in place
        "steps": torch.tensor([7, 8, 9]),
    }


def _metadata(state: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    """TRL's shape of it: dtype without ``torch.``, shape as a list."""
    return [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()]


def resharding(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield a gathered copy of each tensor, and scribble over it once resumed (a re-shard)."""
    for name, t in state.items():
        gathered = t.clone()
        yield name, gathered
        gathered.zero_() if not gathered.is_floating_point() else gathered.fill_(float("nan"))


@pytest.mark.processes
def test_a_round_from_an_iterator_that_reshards_behind_it_is_exact() -> None:
    state = _state()
    module = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("nccl", ModuleSink(module))
    client = InProcessClient([worker], timeout_s=60)
    info = loopback_info(
        world_size=2, packed_buffer_size_bytes=1024, direct_min_bytes=4096, timeout_s=60
    )
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
    try:
        stats = trainer.send_weights(
            StreamSource(_metadata(state), resharding(state)), weight_version="0"
        )
    finally:
        trainer.shutdown()
        worker.shutdown()
    assert_state_equal(module, state)
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert worker.weight_info()["weight_version"] == "0"


def test_each_tensor_is_copied_before_the_iterator_moves_on() -> None:
    state = _state()
    yielded: list[torch.Tensor] = []

    def producer() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in state.items():
            yielded.append(t)
            yield name, t

    got = list(StreamSource(_metadata(state), producer()))
    assert [n for n, _ in got] == list(state)
    for (_, copy), original in zip(got, yielded, strict=True):
        assert torch.equal(copy, original)
        assert copy.data_ptr() != original.data_ptr() or original.numel() == 0


def test_the_iterator_is_read_once() -> None:
    state = _state()
    source = StreamSource(_metadata(state), iter(state.items()))
    assert len(list(source)) == len(state)
    with pytest.raises(ProtocolStateError, match="single-pass"):
        list(source)


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ([("w", "float32")], r"metadata\[0\]: expected \(name, dtype, shape\)"),
        ([("w", "complex32", [2])], r"metadata\[0\]\.dtype: expected one of"),
        ([("w", "float32", [2, -1])], r"metadata\[0\]\.shape: expected non-negative ints"),
        ([(3, "float32", [2])], r"metadata\[0\]: expected a str name"),
    ],
)
def test_bad_metadata_is_refused_naming_the_entry(metadata: list[object], fragment: str) -> None:
    with pytest.raises(PayloadError, match=fragment):
        StreamSource(metadata, iter([]))


def test_install_without_trl_or_with_another_trl_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wtcore_trl

    monkeypatch.delitem(sys.modules, "trl", raising=False)
    if "trl" not in sys.modules:  # this venv has no TRL (it lives in .venv-vllm)
        with pytest.raises(PluginLoadError, match=r"wtcore-trl needs TRL 1\.16"):
            wtcore_trl.install()
    # A TRL whose version and client differ: a stub package first on the path.
    stub = tmp_path / "trl"
    (stub / "generation").mkdir(parents=True)
    (stub / "__init__.py").write_text('__version__ = "0.9.6"\n')
    (stub / "generation" / "__init__.py").write_text("")
    (stub / "generation" / "vllm_generation.py").write_text(
        "class VLLMClient:\n    def init_communicator(self): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with pytest.raises(PluginLoadError) as e:
            wtcore_trl.install()
    finally:  # the stub must not outlive this test
        for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
            del sys.modules[name]
    assert "supports TRL 1.16, found TRL 0.9.6" in str(e.value)
    assert "update_named_params, close_communicator" in str(e.value)


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (torch.device("cpu"), "cpu"),
        (torch.device("cuda", 1), "cuda:1"),
        (torch.device("cuda"), "cuda"),
        (0, "cuda:0"),  # TRL's default: an int is a CUDA index
        ("cpu", "cpu"),
    ],
)
def test_the_engine_stages_on_the_device_trl_passes(device: object, expected: str) -> None:
    """On a GPU trainer nccl must be NCCL (its transport follows the device), gloo on CPU."""
    from wtcore_nccl.config import resolve_transport
    from wtcore_trl.client import engine_device, trainer_info

    derived = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
    info = trainer_info("nccl", {}, {**derived, "device": engine_device(device)})
    assert info.device == expected
    assert resolve_transport(info.transport, info.device) == (
        "gloo" if expected == "cpu" else "nccl"
    )
    # The user's option wins over TRL's device; an engine without the field ignores it.
    pinned = trainer_info("nccl", {"device": "cpu"}, {**derived, "device": expected})
    assert pinned.device == "cpu"
    ipc = trainer_info("ipc", {}, {"device": expected})
    assert ipc.device == expected


@pytest.mark.parametrize("device", [-1, True, None, ""])
def test_another_kind_of_device_is_refused_naming_the_field(device: object) -> None:
    from wtcore_trl.client import engine_device

    with pytest.raises(PayloadError, match=r"^device: expected"):
        engine_device(device)
