"""Config by name: one dict (or JSON/TOML file) builds a trainer engine and its client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from wtcore import (
    CLIENTS,
    ModuleSink,
    PayloadError,
    PluginLoadError,
    TensorSource,
    WeightSyncWorker,
    load_config,
    trainer_from_config,
)
from wtcore.testing import build_module, mixed_dtype_state, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore_kit.inline import InlineTrainerEngine


class _WorkerClient(WeightSyncWorker):
    """A client that is also the receiver, constructible from config keys."""

    def __init__(self, buffer_note: str = "") -> None:
        self.model = build_module(zeros_like_state(mixed_dtype_state()))
        super().__init__("inline", ModuleSink(self.model))


@pytest.fixture
def test_client() -> str:
    CLIENTS.register("test-worker", _WorkerClient)
    yield "test-worker"
    CLIENTS.unregister("test-worker")


def test_config_builds_engine_and_client(test_client: str) -> None:
    state = mixed_dtype_state()
    engine = trainer_from_config(
        {"backend": "inline", "packed_buffer_size_bytes": 256, "client": {"name": test_client}},
        source=TensorSource(state),
    )
    assert isinstance(engine, InlineTrainerEngine)
    assert engine.init_info.packed_buffer_size_bytes == 256  # type: ignore[attr-defined]
    engine.send_weights(weight_version="cfg")
    assert isinstance(engine.client, _WorkerClient)
    assert_state_equal(engine.client.model, state)


def test_unknown_key_lists_valid_keys(test_client: str) -> None:
    with pytest.raises(PayloadError) as exc:
        trainer_from_config({"backend": "inline", "bufer_size": 1, "client": {"name": test_client}})
    assert str(exc.value) == (
        "config: unknown key(s) 'bufer_size' for backend 'inline'; "
        "valid keys: backend, client, delta, delta_base_device, staged, packed, "
        "packed_buffer_size_bytes, packed_num_buffers, timeout_s"
    )


def test_unknown_client_key_lists_valid_keys(test_client: str) -> None:
    with pytest.raises(
        PayloadError,
        match=r"config.client: unknown key\(s\) 'urls' for client 'test-worker'; valid keys: name, buffer_note",
    ):
        trainer_from_config({"backend": "inline", "client": {"name": test_client, "urls": []}})


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"client": {}}, PayloadError, "config.backend: expected a backend name, got None"),
        ({"backend": "inline"}, PayloadError, "config.client: missing"),
        (
            {"backend": "inline", "packed_buffer_size_bytes": "big", "client": {"name": "x"}},
            PayloadError,
            "config.packed_buffer_size_bytes: expected int, got str",
        ),
        (
            {"backend": "inline", "packed_buffer_size_bytes": -1, "client": {"name": "x"}},
            PayloadError,
            "packed_buffer_size_bytes: expected a positive integer",
        ),
        ({"backend": "lokal", "client": {}}, PluginLoadError, "Did you mean 'inline'"),
        (
            {"backend": "inline", "client": {"name": "htp"}},
            PluginLoadError,
            "unknown client 'htp'",
        ),
    ],
)
def test_config_errors(config: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        trainer_from_config(config)


def test_non_sender_rank_needs_no_client() -> None:
    engine = trainer_from_config(
        {"backend": "inline"}, rank=1, source=TensorSource({"w": torch.ones(2)})
    )
    assert engine.client is None
    assert engine.send_weights().num_tensors == 1


def test_json_and_toml_files(tmp_path: Path, test_client: str) -> None:
    (tmp_path / "c.json").write_text(
        json.dumps({"backend": "inline", "client": {"name": test_client}})
    )
    (tmp_path / "c.toml").write_text(
        f'backend = "inline"\npacked_buffer_size_bytes = 4096\n[client]\nname = "{test_client}"\n'
    )
    assert load_config(tmp_path / "c.toml") == {
        "backend": "inline",
        "packed_buffer_size_bytes": 4096,
        "client": {"name": test_client},
    }
    for name in ("c.json", "c.toml"):
        engine = trainer_from_config(tmp_path / name)
        assert isinstance(engine, InlineTrainerEngine)
    (tmp_path / "c.yaml").write_text("")
    with pytest.raises(ValueError, match=r"must end in .json or .toml, got 'c.yaml'"):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("backend", ["inline", "nccl", "ipc"])
def test_sender_without_a_client_is_refused_before_anything_starts(backend: str) -> None:
    from wtcore import TRAINER_ENGINES, WeightTransferTrainerFactory

    if backend not in TRAINER_ENGINES.names():
        pytest.skip(f"{backend} is not installed")
    info_cls = TRAINER_ENGINES.load(backend).init_info_cls
    extra = (
        {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
        if backend == "nccl"
        else {}
    )
    with pytest.raises(ValueError, match=r"trainer_init: the sender \(rank 0\) needs a client"):
        WeightTransferTrainerFactory.trainer_init(info_cls(**extra, rank=0), client=None)


def test_the_buffer_option_name_0_1_deprecated_is_gone(test_client: str) -> None:
    """0.1.0 said ``buffer_size_bytes`` would go in the next release: it is an unknown key."""
    with pytest.raises(PayloadError, match="buffer_size_bytes"):
        trainer_from_config(
            {"backend": "inline", "buffer_size_bytes": 512, "client": {"name": test_client}}
        )
