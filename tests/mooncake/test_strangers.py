"""Strangers on a Mooncake engine's ports, over real transfer engines on loopback.

Mooncake has no authentication: any process that reaches a transfer engine's ports can learn
its registered buffers and read or write them (docs/mooncake.md, "Trust"). So a receiver
registers the model's memory only while its own read runs, and a stranger's write between
rounds is refused by Mooncake itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.testing import build_module, zeros_like_state
from wtcore.testing.contract import assert_state_equal
from wtcore.testing.procs import stop_processes
from wtcore_kit.inproc import InProcessClient
from wtcore_mooncake import MooncakeTrainerInitInfo
from wtcore_mooncake.worker import MooncakeWorkerEngine

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

#: A stranger: its own transfer engine writes ``n`` bytes of 0x55 at ``address`` of the engine
#: at ``endpoint`` (no handshake of wtcore's, no credentials); prints Mooncake's status.
STRANGER = """
import json, sys, torch
from mooncake.engine import TransferEngine
endpoint, address, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = torch.full((n,), 0x55, dtype=torch.uint8)
assert engine.register_memory(buf.data_ptr(), n) == 0
print(json.dumps({"rc": engine.transfer_sync_write(endpoint, buf.data_ptr(), address, n)}))
"""


def _stranger_writes(endpoint: str, address: int, n: int) -> int:
    """Run :data:`STRANGER` against ``endpoint``; Mooncake's status of its write (0: written)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STRANGER, endpoint, str(address), str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        stop_processes([proc], 5)
    return int(json.loads(out)["rc"])


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # three buckets of 4 KiB: the round's first goes through staging, the others in place
    return {f"embed_tokens.{i}": torch.randn(1024, generator=g) for i in range(3)}


def _synced() -> tuple[WeightSyncWorker, Any, torch.nn.Module, dict[str, torch.Tensor]]:
    """A worker after one real round (source reads), its trainer, model and the state sent."""
    state = _state()
    model = build_module(zeros_like_state(state))
    worker = WeightSyncWorker("mooncake", ModuleSink(model))
    info = MooncakeTrainerInitInfo(packed_buffer_size_bytes=4096, timeout_s=30, rank=0)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=InProcessClient(worker, timeout_s=30), source=TensorSource(state)
    )
    trainer.send_weights(weight_version="v1")
    assert_state_equal(model, state)
    return worker, trainer, model, state


def test_a_stranger_cannot_write_the_published_model_between_rounds() -> None:
    """A stranger's transfer engine writes into a tensor the last round read in place:
    Mooncake refuses it (the worker registered it only while its read ran), and the model,
    still reported ``consistent``, holds exactly the round's bytes."""
    worker, trainer, model, state = _synced()
    try:
        engine = worker.engine
        assert isinstance(engine, MooncakeWorkerEngine)
        assert engine.in_place_bytes >= 2 * 4096  # the last two, at least, read in place
        target = model.get_parameter("embed_tokens.2")
        rc = _stranger_writes(engine.endpoint, target.data_ptr(), 4096)
        assert rc != 0, "a stranger wrote into the published model"
        assert_state_equal(model, state)
        assert worker.weight_info()["consistent"] is True
    finally:
        trainer.shutdown()
        worker.shutdown()
