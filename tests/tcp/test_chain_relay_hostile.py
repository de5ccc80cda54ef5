"""A relay that lies: the receiver behind it refuses, survives, and never reports the round.

In ``topology="chain"`` every receiver but the last forwards what it received. On gloo a relay
that forwarded a message longer than planned killed the next receiver (gloo aborts the process,
SIGABRT), and one that forwarded a shorter message left the next receiver's buffer tail stale,
which then published the round ``consistent: true`` (without CRCs, the default). The chain's
hops are size-checked TCP streams (:mod:`wtcore_tcp.chain`; nccl refuses its chain on gloo).

Here the trainer and the first receiver (group rank 1, the relay) are honest about the
trainer's bytes, but the relay process is patched to forward the big tensor's message with a
longer or shorter length, with its true length and fewer bytes, or whole with one byte flipped
(the next receiver published that as ``consistent: true`` unless ``checksum`` was on; the
chain now checks the trainer's CRC-32 of every message on every rank, by default). Real
processes, real sockets.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.nccl.nccl_e2e_kit import Fleet, fleet, make_state
from wtcore import ReceiverError, TensorSource, TransferError, WeightTransferTrainerFactory
from wtcore.testing import spec_of, wait_until
from wtcore_tcp import TCPTrainerInitInfo

if TYPE_CHECKING:
    from collections.abc import Iterator

    from wtcore.worker import WeightSyncWorker

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

TIMEOUT_S = 10.0
#: float32 elements of the big tensor (sent in place, a message of its own, several chunks).
BIG_NUMEL = 700_000
BIG_BYTES = BIG_NUMEL * 4
SKEW = 4096


def _lie(mode: str) -> str:
    """Runs in the relay's process: forward the big message with a lie (``""``: honestly)."""
    from wtcore_tcp import streams as stream

    honest = getattr(stream, "_honest_send", stream._send_message)
    stream._honest_send = honest  # type: ignore[attr-defined]

    def send(sock: Any, view: memoryview, total: int | None = None) -> None:
        n = len(view) if total is None else total
        if n != BIG_BYTES:
            honest(sock, view, total)
        elif mode == "longer":  # a length the next receiver did not plan, and the bytes
            honest(sock, view, n + SKEW)
            sock.sendall(bytes(SKEW))
        elif mode == "shorter":
            honest(sock, view[: len(view) - SKEW], n - SKEW)
        elif mode == "flipped":  # the true length and every byte, one of them changed
            changed = bytearray(view)
            changed[len(changed) // 2] ^= 0x10
            honest(sock, memoryview(changed), total)
        else:  # "withheld": the true length, fewer bytes, then the next messages go on
            honest(sock, view[: len(view) - SKEW], n)

    stream._send_message = honest if not mode else send  # type: ignore[assignment]
    return mode


def _handlers(worker: WeightSyncWorker) -> dict[str, Any]:
    return {"lie": _lie}


def _state(seed: int) -> dict[str, torch.Tensor]:
    return make_state(seed, big=BIG_NUMEL, count=20)


@pytest.fixture(scope="module")
def two() -> Iterator[Fleet]:
    """Two receiver processes: rank 1 relays to rank 2."""
    with fleet(
        2, spec_of(_state(0)), timeout_s=3 * TIMEOUT_S, extra=_handlers, backend="tcp", options={}
    ) as f:
        yield f


@pytest.mark.parametrize("mode", ["longer", "shorter", "withheld", "flipped"])
def test_a_lying_relay_fails_the_round_and_the_next_receiver_survives(
    two: Fleet, mode: str
) -> None:
    info = TCPTrainerInitInfo(
        address="127.0.0.1", world_size=3, topology="chain", timeout_s=TIMEOUT_S,
        packed_buffer_size_bytes=16 << 10, rank=0,
    )  # fmt: skip
    assert not info.checksum  # the default: sizes must hold without CRCs
    with WeightTransferTrainerFactory.trainer_init(info, client=two.client) as trainer:
        good = _state(1)
        trainer.send_weights(TensorSource(good), weight_version="good")
        two.assert_synced(good, "good")

        two.client.call(0, "lie", mode)
        try:
            t0 = time.monotonic()
            with pytest.raises((TransferError, ReceiverError)) as exc:
                trainer.send_weights(TensorSource(_state(2)), weight_version="bad")
            took = time.monotonic() - t0
            print(f"{mode}: after {took:.1f} s: {type(exc.value).__name__}: {exc.value}")
            assert took < 3 * TIMEOUT_S
            for i, proc in enumerate(two.procs):
                assert proc.is_alive(), f"receiver {i} died (exit code {proc.exitcode})"
                wait_until(
                    lambda i=i: two.client.call(i, "weight_info")["state"] == "idle",
                    2 * TIMEOUT_S,
                    f"receiver {i} to end the round",
                )
                got = two.client.call(i, "weight_info")
                assert (got["weight_version"], got["consistent"]) == ("good", False), (i, got)
            behind = two.client.call(1, "weight_info")["last_error"]
            if mode == "withheld":
                # Bytes that never come look like a stall: the receiver waits for the rest
                # until its own timeout or the trainer's (whichever ends first), and the
                # misread messages behind are never applied as a round.
                relay = "from rank 1 (the previous rank of the chain)"
                assert relay in behind or "abandoned the round" in behind, behind
            elif mode == "flipped":  # every byte came, the trainer's CRC-32 did not match
                relay = "from rank 1 (the previous rank of the chain)"
                assert relay in behind, behind
                assert "bytes changed on the way" in behind, behind
            else:  # refused by its length, before a byte of it was read
                planned = f"sent {BIG_BYTES + (SKEW if mode == 'longer' else -SKEW)} bytes "
                assert "(rank 1)" in behind, behind
                assert planned + f"where this receiver planned {BIG_BYTES}" in behind, behind
        finally:
            two.client.call(0, "lie", "")

        # The chain recovers on the next round (a new handshake, new streams), bit-exact.
        fresh = _state(3)
        trainer.send_weights(TensorSource(fresh), weight_version="fresh")
        two.assert_synced(fresh, "fresh")
