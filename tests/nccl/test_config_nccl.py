"""Init/update info validation, the derived worker handshake, options and host status."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wtcore import ModuleSink, PayloadError, WeightSyncWorker
from wtcore.registry import ENGINES, TRAINER_ENGINES
from wtcore.testing import build_module
from wtcore_channel import DEFAULT_DIRECT_MIN_BYTES
from wtcore_nccl import NCCLInitInfo, NCCLTrainerInitInfo
from wtcore_nccl.config import resolve_transport

BASE = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 3}


def test_registered_under_nccl() -> None:
    assert TRAINER_ENGINES.load("nccl").__name__ == "NCCLTrainerEngine"
    assert ENGINES.load("nccl").__name__ == "NCCLWorkerEngine"
    assert NCCLTrainerInitInfo.backend == "nccl"


def test_worker_init_info_is_derived_from_the_trainer() -> None:
    info = NCCLTrainerInitInfo(
        **BASE, packed=False, packed_buffer_size_bytes=4096, packed_num_buffers=3, rank=0
    )
    wire = info.worker_init_info().to_wire()
    assert wire == {
        **BASE,
        "rank_offset": 1,
        "packed": False,
        "packed_buffer_size_bytes": 4096,
        "packed_num_buffers": 3,
        "timeout_s": info.timeout_s,
        "transport": "gloo",
        "secret": "",
        "direct_min_bytes": DEFAULT_DIRECT_MIN_BYTES,
        "broadcast": "collective",  # auto: the collective (the chain on gloo is tcp's)
        "checksum": False,
    }
    assert info.worker_init_info("ab" * 16).to_wire()["secret"] == "ab" * 16
    assert NCCLTrainerInitInfo(**BASE, rank=0).packed_buffer_size_bytes == 64 << 20
    assert NCCLTrainerInitInfo(**BASE, rank=0).packed_num_buffers == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("master_port", 0),
        ("master_port", 70000),
        ("world_size", 1),
        ("packed_buffer_size_bytes", 0),
        ("packed_num_buffers", 0),
        ("timeout_s", 0.0),
        ("transport", "mpi"),
        ("broadcast", "ring"),
        ("torch_num_threads", 0),
    ],
)
def test_trainer_init_info_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        NCCLTrainerInitInfo(**{**BASE, field: value}, rank=0)  # type: ignore[arg-type]


def test_broadcast_auto_is_the_collective_and_the_chain_runs_on_nccl_only() -> None:
    """nccl is torch.distributed: its default is the process group's own broadcast (NCCL's
    already pipelines through a ring). Its chain relays point to point, and on gloo a relay's
    message lengths cannot be checked (gloo aborts the receiver), so it is refused there,
    naming the field and tcp's chain."""
    base = dict(BASE)
    assert NCCLTrainerInitInfo(**base, rank=0).worker_init_info().broadcast == "collective"
    cuda = NCCLTrainerInitInfo(**base, device="cuda", rank=0)
    assert cuda.worker_init_info().broadcast == "collective"
    chained = NCCLTrainerInitInfo(**base, device="cuda", broadcast="chain", rank=0)
    assert chained.worker_init_info().broadcast == "chain"
    with pytest.raises(PayloadError, match="broadcast: 'chain' runs on NCCL only.*tcp"):
        NCCLTrainerInitInfo(**base, broadcast="chain", rank=0)
    with pytest.raises(PayloadError, match="broadcast: 'chain' runs on NCCL only.*tcp"):
        NCCLInitInfo(**base, rank_offset=1, transport="gloo", broadcast="chain")
    with pytest.raises(PayloadError, match="broadcast: 'chain' runs on NCCL only"):
        _worker().init_weight_transfer_engine({**base, "rank_offset": 1, "broadcast": "chain"})
    with pytest.raises(ValueError, match="broadcast"):
        NCCLInitInfo(**base, rank_offset=1, broadcast="auto")  # workers get a concrete mode
    with pytest.raises(ValueError, match="checksum: expected a bool"):
        NCCLInitInfo(**base, rank_offset=1, checksum="yes")  # type: ignore[arg-type]


def test_transport_follows_the_device_unless_forced() -> None:
    assert resolve_transport("auto", "cpu") == "gloo"
    assert resolve_transport("auto", "cuda:1") == "nccl"
    assert resolve_transport("gloo", "cuda") == "gloo"
    info = NCCLTrainerInitInfo(**BASE, device="cuda", rank=0)
    assert info.worker_init_info().transport == "nccl"


def _worker(rank: int = 0, world_size: int = 1, **options: object) -> WeightSyncWorker:
    import torch

    sink = ModuleSink(build_module({"w": torch.zeros(2)}))
    return WeightSyncWorker({"backend": "nccl", **options}, sink, rank=rank, world_size=world_size)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"rank_offset": 0}, "rank_offset"),
        ({"master_port": "29500"}, "master_port"),
        ({"packed": 1}, "packed"),
        ({"packed_buffer_size_bytes": -1}, "packed_buffer_size_bytes"),
        ({"world_size": 2, "bogus": 1}, "bogus"),
        ({"secret": "not-hex-and-too-short"}, "secret"),
        ({"secret": "AB" * 16}, "secret"),
        ({"secret": 12345}, "secret"),
    ],
)
def test_worker_rejects_bad_init_info_naming_the_field(
    patch: dict[str, object], field: str
) -> None:
    worker = _worker()
    good = {**BASE, "rank_offset": 1}
    with pytest.raises(PayloadError, match=field):
        worker.init_weight_transfer_engine({**good, **patch})
    assert worker.weight_info()["state"] == "uninitialized"


def test_worker_rejects_a_rank_outside_the_world() -> None:
    worker = _worker(rank=1, world_size=2)
    with pytest.raises(PayloadError, match=r"world_size: 2 is too small.*would be rank 2"):
        worker.init_weight_transfer_engine({**BASE, "world_size": 2, "rank_offset": 1})


def test_worker_rejects_nccl_on_a_cpu_device() -> None:
    with pytest.raises(PayloadError, match="transport: 'nccl' needs a CUDA device"):
        _worker().init_weight_transfer_engine({**BASE, "rank_offset": 1, "transport": "nccl"})


def test_worker_rejects_bad_update_info() -> None:
    engine = _worker().engine
    with pytest.raises(PayloadError, match=r"dtype_names\[0\]"):
        engine.parse_update_info({"names": ["w"], "dtype_names": ["float128"], "shapes": [[2]]})
    with pytest.raises(PayloadError, match="shapes"):
        engine.parse_update_info({"names": ["w"], "dtype_names": ["float32"]})
    ok = engine.parse_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    assert ok.metas[0].nbytes == 4
    assert NCCLInitInfo(**BASE, rank_offset=1).packed is True


def test_worker_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown 'threads'.*torch_num_threads"):
        _worker(threads=1)
    with pytest.raises(ValueError, match="torch_num_threads"):
        _worker(torch_num_threads=0)


def test_host_status_names_the_paths() -> None:
    status = ENGINES.load("nccl").host_status()
    assert "gloo CPU path available" in status
    assert "CUDA" in status


@pytest.mark.processes
def test_import_does_not_import_torch() -> None:
    code = "import sys, wtcore_nccl; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_non_sender_ranks_iterate_in_lockstep_without_client_or_group() -> None:
    import torch

    from wtcore import TensorSource
    from wtcore.factory import WeightTransferTrainerFactory

    state = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    info = NCCLTrainerInitInfo(**BASE, rank=1)  # nothing listens on BASE's port: never contacted
    with WeightTransferTrainerFactory.trainer_init(info, client=None) as trainer:
        stats = trainer.send_weights(TensorSource(state))
    assert stats.num_tensors == 2 and stats.num_bytes == 12 + 4
