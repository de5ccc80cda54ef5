"""An in-place receive of an abandoned round must not land on top of a newer round.

gloo cannot cancel a posted receive: it runs until its bytes arrive, the peer closes, or the
group's timeout. Here a trainer announces a large tensor (its frame header), the receiver
posts the receive straight into its parameter, and the round is abandoned (``abort()``, what
the receiver does when a new trainer's init arrives). A new trainer then syncs the receiver
while the old one still holds its connection, and only afterwards does the old trainer send
its stale bytes. The receiver must not let them overwrite the new round: it writes nothing of
the new round before the old receive ended, so the model ends up exactly the new round's, and
``consistent: true`` is true.

Over tcp's streams the abort closes the connection, which ends the receive at once: the new
round is not held, and the old trainer's bytes have nowhere to land.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.nccl.test_stale_notice import channel_info
from wtcore import ModuleSink, TensorSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.buckets import as_bytes
from wtcore.errors import TransferError
from wtcore.meta import ParamMeta, metas_to_wire
from wtcore.testing import build_module, wait_until
from wtcore_channel.frames import make_header
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.inproc import InProcessClient

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TIMEOUT_S = 30.0
#: How long the old trainer holds its stale bytes after the new trainer started its round.
STALE_AFTER_S = 3.0


@pytest.mark.parametrize("backend", ["nccl", "tcp"])
def test_a_stale_in_place_receive_never_lands_on_a_newer_round(backend: str) -> None:
    module = build_module({"s": torch.zeros(4), "v": torch.zeros(64, 64), "w": torch.zeros(64, 64)})
    worker = WeightSyncWorker(backend, ModuleSink(module))
    engine = worker.engine
    old_client = InProcessClient(worker, timeout_s=TIMEOUT_S)
    old = WeightTransferTrainerFactory.trainer_init(channel_info(backend), client=old_client)
    stream = backend == "tcp"
    new = None
    try:
        # The old trainer sends buckets 0 ("s") and 1 ("v"), then announces bucket 2 ("w":
        # its frame header) and stalls. (A round's first buckets are staged: in place needs
        # the first batch loaded, which says that the round is not a delta round.)
        old_state = {"s": torch.ones(4), "v": torch.ones(64, 64), "w": torch.full((64, 64), 7.0)}
        old_client.start_weight_update()
        rpc = BackgroundCall(
            old_client.update_weights,
            metas_to_wire([ParamMeta.of(n, t) for n, t in old_state.items()]),
        )
        group = old._channel  # type: ignore[attr-defined]
        for index, name in enumerate(old_state):
            data = as_bytes(old_state[name])
            if not stream:  # the stream's length prefix stands in for the header
                group.broadcast(make_header(index, data, "cpu", checksum=False)).wait()
            if name != "w":
                group.broadcast(data).wait()
        stale = old_state["w"]
        wait_until(lambda: engine._in_place, 10.0, "the in-place receive to be posted")  # type: ignore[attr-defined]
        # The receiver gives up on the old trainer (as on a new trainer's init).
        engine.abort()
        wait_until(rpc.done, 10.0, "the old round to end")
        assert rpc.error is not None
        # A new trainer syncs the receiver while the old one still holds its bytes.
        fresh = {n: torch.randn(t.shape) for n, t in old_state.items()}
        new = WeightTransferTrainerFactory.trainer_init(
            channel_info(backend), client=InProcessClient(worker, timeout_s=TIMEOUT_S)
        )
        send = BackgroundCall(new.send_weights, TensorSource(fresh), weight_version="new")
        if stream:  # the closed stream ended the old receive: nothing holds it
            send.result(TIMEOUT_S)
            try:  # the old trainer's bytes go nowhere (its connection was shut down)
                group.broadcast(as_bytes(stale)).wait()
            except (RuntimeError, TransferError):
                pass
        else:
            time.sleep(STALE_AFTER_S)  # a small round takes well under this when not held
            assert not send.done(), "the new round wrote while a stale receive was pending"
            group.broadcast(as_bytes(stale)).wait()  # the stale bytes arrive at last
            send.result(TIMEOUT_S)
        late = list(engine._late)  # type: ignore[attr-defined]
        wait_until(lambda: all(w.is_completed() for w in late), 10.0, "the stale receive to land")
        time.sleep(0.5)
        for name, want in fresh.items():
            assert torch.equal(module.get_parameter(name).detach(), want), name
        info = worker.weight_info()
        assert (info["weight_version"], info["consistent"]) == ("new", True)
    finally:
        if new is not None:
            new.shutdown()
        old.shutdown()
        worker.shutdown()
