"""The shared pipe control plane (``wtcore.testing.pipes``) with real child processes.

The nccl and ipc tests and both benchmarks drive their receivers through it, so its promises
are checked here once, on the ``inline`` engine (no data plane to set up): a full round is
bit-exact, remote errors keep their type, and a dead or stopped child costs one bounded
timeout instead of a hang.
"""

from __future__ import annotations

import base64
import functools
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest
import torch

from wtcore import (
    ModuleSink,
    PayloadError,
    ProtocolStateError,
    ReceiverError,
    TensorSource,
    TransferError,
    TransferTimeoutError,
    WeightSyncWorker,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore.errors import ErrorRecord
from wtcore.testing import build_module, mixed_dtype_state, zeros_like_state
from wtcore.testing.pipes import (
    PipeChannel,
    PipeFleet,
    RemoteError,
    decode_state,
    encode_state,
    pipe_fleet,
    serve,
)
from wtcore.testing.procs import freeze
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

TIMEOUT_S = 3.0


def _fleet(n: int, state: dict[str, torch.Tensor]) -> AbstractContextManager[PipeFleet]:
    """Context manager for ``n`` children, each a ``inline`` worker over a zero model."""
    makes = [
        functools.partial(
            WeightSyncWorker,
            "inline",
            ModuleSink(build_module(zeros_like_state(state))),
            rank=i,
            world_size=n,
        )
        for i in range(n)
    ]
    return pipe_fleet(makes, timeout_s=TIMEOUT_S, ready_timeout_s=60.0)


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return dict(mixed_dtype_state(0))


@pytest.fixture
def two(state: dict[str, torch.Tensor]) -> Iterator[PipeFleet]:
    with _fleet(2, state) as f:
        yield f


def test_round_through_children_is_bit_exact(
    two: PipeFleet, state: dict[str, torch.Tensor]
) -> None:
    info = InlineTrainerInitInfo(packed_buffer_size_bytes=4096, rank=0)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=two.client, source=TensorSource(state)
    ) as trainer:
        trainer.send_weights(weight_version="v1")
    want = digest_named(state.items())
    assert two.client.checksums() == [want, want]
    # one return shape, as for every fan-out client: a list in receiver order
    assert [w["weight_version"] for w in two.client.weight_info()] == ["v1", "v1"]
    for i in range(2):
        assert two.client.call(i, "weight_info")["weight_version"] == "v1"


def test_remote_errors_keep_type_name_and_class(two: PipeFleet) -> None:
    two.client.init_weight_transfer_engine({"packed_buffer_size_bytes": 4096})
    two.client.call(0, "start_weight_update")
    with pytest.raises(ProtocolStateError) as exc:  # start twice
        two.client.call(0, "start_weight_update")
    assert isinstance(exc.value, RemoteError)
    assert type(exc.value).__name__ == "ProtocolStateError" and exc.value.status == 409
    assert "worker[rank=0].start_weight_update" in str(exc.value)
    with pytest.raises(PayloadError):  # and so a ValueError, as in-process
        two.client.call(0, "update_weights", {"nonsense": 1})
    # fanned out (worker 1 is idle, so only worker 0 fails): one ReceiverError, naming the
    # failing receiver and the remote type
    with pytest.raises(ReceiverError) as fan:
        two.client.start_weight_update()
    assert [f.receiver for f in fan.value.failures] == ["worker[rank=0]"]
    assert fan.value.failures[0].error_type == "ProtocolStateError"
    assert fan.value.failures[0].status == 409


def test_killed_child_is_an_error_within_the_timeout(two: PipeFleet) -> None:
    two.client.init_weight_transfer_engine({"packed_buffer_size_bytes": 4096})
    victim = two.procs[1]
    victim.kill()  # SIGKILL, by the PID of a process this test started
    victim.join(10)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=r"worker\[rank=1\].weight_info: child process"):
        two.client.call(1, "weight_info")
    with pytest.raises(ReceiverError) as exc:
        two.client.start_weight_update()
    assert time.monotonic() - t0 < TIMEOUT_S
    assert [f.receiver for f in exc.value.failures] == ["worker[rank=1]"]
    assert two.client.call(0, "weight_info")["state"] == "updating"  # the survivor is unaffected


def test_stopped_child_times_out_then_recovers(two: PipeFleet) -> None:
    pid = two.procs[0].pid
    assert pid is not None
    freeze(pid)  # alive but silent: only the timeout can end the wait
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="no answer within 1 s"):
            two.client.call(0, "weight_info", timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0 + 1.0
    finally:
        os.kill(pid, signal.SIGCONT)
    # the late answer to the abandoned call is skipped; the next call gets its own answer
    assert two.client.call(0, "weight_info")["state"] in ("uninitialized", "idle")


def test_state_encoding_is_exact_json() -> None:
    import json

    state = dict(mixed_dtype_state(1))
    state["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    state["empty"] = torch.empty(0, 3, dtype=torch.float16)
    state["mask"] = torch.tensor([True, False, True])
    got = decode_state(json.loads(json.dumps(encode_state(state))))
    assert list(got) == list(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_a_child_error_crosses_as_its_record() -> None:
    """The child answers with the ErrorRecord's keys (those of an HTTP error body)."""
    parent, child = mp.Pipe()

    def boom() -> None:
        raise TransferTimeoutError("slow")

    server = threading.Thread(target=serve, args=(child, {"boom": boom}), daemon=True)
    server.start()
    try:
        parent.send_bytes(json.dumps({"id": 7, "call": "boom", "args": []}).encode())
        answer = json.loads(parent.recv_bytes())
        assert answer == {
            "id": 7,
            "ok": False,
            "error": "slow",
            "error_type": "TransferTimeoutError",
            "status": 504,
        }
        e = ErrorRecord.from_json(answer).to_exception("w0.update_weights")
        assert isinstance(e, TransferTimeoutError) and isinstance(e, TimeoutError)
        assert (
            isinstance(e, RemoteError) and str(e) == "w0.update_weights: TransferTimeoutError: slow"
        )
    finally:
        parent.send_bytes(json.dumps({"id": 8, "call": "exit"}).encode())
        server.join(10)
        parent.close()


def test_a_malformed_error_answer_is_a_transfer_error() -> None:
    """A child's error record is checked before it is believed: a bad one names the field."""
    parent, child = mp.Pipe()
    bad = {"ok": False, "error": "x", "error_type": "no spaces allowed", "status": 500}

    def answer() -> None:
        req = json.loads(child.recv_bytes())
        child.send_bytes(json.dumps({"id": req["id"], **bad}).encode())

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    channel = PipeChannel(parent, "w0", timeout_s=TIMEOUT_S)
    with pytest.raises(TransferError, match=r"w0.ping: .*malformed error.*error_record.error_type"):
        channel.call("ping")
    t.join(10)
    parent.close()
    child.close()


def test_decoding_checks_the_state_like_an_update() -> None:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    good = json.loads(json.dumps(encode_state(state)))
    assert set(good) == {"names", "dtype_names", "shapes", "data"}
    with pytest.raises(PayloadError, match="shapes\\[0\\]"):
        decode_state({**good, "shapes": [[-1, 3]]})
    with pytest.raises(PayloadError, match="data: 20 bytes, but the metadata plans 24"):
        decode_state({**good, "data": base64.b64encode(bytes(20)).decode()})
    assert decode_state({"names": [], "dtype_names": [], "shapes": [], "data": ""}) == {}


def test_a_remote_error_reads_like_every_transport() -> None:
    from wtcore.errors import ReceiverTimeoutError
    from wtcore_kit.fanout import failure_of

    e = ErrorRecord("ProtocolStateError", "start twice", 409).to_exception("w0.start_weight_update")
    failure = failure_of("w0", e)
    assert (failure.error_type, failure.message, failure.status) == (
        "ProtocolStateError",
        "start twice",
        409,
    )
    # a ReceiverError's constructor takes failures: the name survives, the call does not fail
    odd = ErrorRecord("ReceiverTimeoutError", "x", 504).to_exception()
    assert type(odd) is RemoteError and odd.record.type == "ReceiverTimeoutError"
    assert not isinstance(odd, ReceiverTimeoutError)
