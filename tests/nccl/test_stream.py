"""The streamed broadcast (``broadcast="stream"``): real TCP connections on loopback.

Rounds over worker processes are bit-exact with one and two workers (a fan-out), packed and
unpacked, with and without CRCs, and across a re-handshake. The stream's own guards are
tested on groups whose ranks run on threads of this process (real sockets, a real store): a
message of another size than the receive posted for it is refused before a byte of it lands;
a stranger on the sender's stream port is dropped while the real worker still joins; a
sender that disappears mid-message, or stalls, fails the receive with an error naming it.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from nccl_e2e_kit import fleet, groups_on_threads, join_loopback, loopback_info, make_state, spec_of

from wtcore import ModuleSink, PayloadError, TensorSource, WeightTransferTrainerFactory
from wtcore.concurrency import BackgroundCall
from wtcore.engine import WeightTransferConfig
from wtcore.errors import TransferError
from wtcore.testing import build_module, free_port
from wtcore_nccl import NCCLInitInfo, stream
from wtcore_nccl.group import Group, connect_store, host_store, release_group
from wtcore_nccl.pipeline import wait_work
from wtcore_nccl.stream import PORT_KEY
from wtcore_nccl.worker import NCCLWorkerEngine

pytestmark = [pytest.mark.timeout(180)]

SECRET = "ab" * 16


@pytest.mark.parametrize("workers", [1, 2])
def test_stream_rounds_are_bit_exact(workers: int) -> None:
    state0 = make_state(0)
    with fleet(workers, spec_of(state0)) as f:
        seed = 1
        for packed, checksum in ((True, False), (True, True), (False, False)):
            info = loopback_info(
                world_size=1 + workers,
                timeout_s=20.0,
                torch_num_threads=1,
                broadcast="stream",
                packed=packed,
                checksum=checksum,
                packed_buffer_size_bytes=16 << 10,
                direct_min_bytes=4096,  # the big tensor in place, the tiny ones packed
            )
            assert info.worker_init_info().broadcast == "stream"
            with WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer:
                for _ in range(2):
                    state = make_state(seed)
                    seed += 1
                    version = f"stream-{packed}-{checksum}-{seed}"
                    trainer.send_weights(TensorSource(state), weight_version=version)
                    f.assert_synced(state, version)
                trainer.handshake()  # new streams, same workers
                state = make_state(seed)
                trainer.send_weights(TensorSource(state), weight_version="after-rehandshake")
                f.assert_synced(state, "after-rehandshake")


@contextmanager
def _pair(timeout_s: float = 30.0) -> Iterator[list[Group]]:
    """A stream group of two ranks on threads of this process; released on exit."""
    with groups_on_threads(2, broadcast="stream", timeout_s=timeout_s, secret=SECRET) as g:
        yield g


def test_a_message_of_another_size_is_refused_before_a_byte_lands() -> None:
    with _pair() as (sender, receiver):
        buf = torch.zeros(64, dtype=torch.uint8)
        work = receiver.broadcast(buf)
        sender.broadcast(torch.full((100,), 7, dtype=torch.uint8))
        with pytest.raises(TransferError, match="sent 100 bytes where this receiver planned 64"):
            wait_work(work, what="the receive", timeout_s=30)
        assert torch.equal(buf, torch.zeros(64, dtype=torch.uint8))  # nothing of it landed
        # The stream cannot be resynchronised: every later receive fails at once.
        with pytest.raises(TransferError, match="failed earlier"):
            wait_work(receiver.broadcast(buf), what="the next receive", timeout_s=30)


def test_messages_arrive_in_order_bit_exact() -> None:
    with _pair() as (sender, receiver):
        sent = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (0, 1, 48, 70_000, 3 << 20)]
        got = [torch.zeros_like(t) for t in sent]
        recvs = [receiver.broadcast(t) for t in got]
        sends = [sender.broadcast(t) for t in sent]
        for w in [*sends, *recvs]:
            wait_work(w, what="a message", timeout_s=30)
        for a, b in zip(sent, got, strict=True):
            assert torch.equal(a, b)
        with pytest.raises(TransferError, match="contiguous CPU tensors only"):
            sender.broadcast(torch.zeros(8, 8)[:, 0])


def test_a_stranger_on_the_stream_port_is_dropped() -> None:
    """Strangers who found the port (garbage, a hello with a wrong token) are closed without
    an acknowledgement; the real rank 1, connecting after them, still joins."""
    import torch.distributed as dist

    port = free_port()
    master = host_store("127.0.0.1", port, 2, 30)
    rank1 = dist.PrefixStore(f"wtcore/nccl/s/{SECRET}/", connect_store("127.0.0.1", port, 30))
    rank1.add("arrived/1", 1)  # rank 1 arrives; it opens its stream below, after the strangers
    sender_call = BackgroundCall(join_loopback, master, 0, port, 2, 30.0, "stream", SECRET)
    strangers: list[socket.socket] = []
    sender: Group | None = None
    worker = None
    try:
        deadline = time.monotonic() + 30
        while not rank1.check([PORT_KEY]):
            assert time.monotonic() < deadline, "the sender never published its stream port"
            time.sleep(0.01)
        stream_port = int(bytes(rank1.get(PORT_KEY)))
        for hello in (
            b"GET / HTTP/1.0\r\n\r\n" + bytes(30),
            struct.pack("<QQQ32s", int.from_bytes(b"wtchelo1", "big"), 1, 0, b"\0" * 32),
        ):
            s = socket.create_connection(("127.0.0.1", stream_port), timeout=10)
            s.sendall(hello)
            strangers.append(s)
        for s in strangers:  # each was closed without an acknowledgement
            assert s.recv(1) == b""
        worker = stream.connect(
            rank1, rank=1, world_size=2, address="127.0.0.1", secret=SECRET, generation=1,
            timeout_s=30,
        )  # fmt: skip
        sender = sender_call.result(30)
        buf = torch.zeros(1000, dtype=torch.uint8)
        want = torch.arange(1000).to(torch.uint8)
        recv = worker.broadcast(buf)
        wait_work(sender.broadcast(want), what="send", timeout_s=30)  # type: ignore[arg-type]
        wait_work(recv, what="receive", timeout_s=30)  # type: ignore[arg-type]
        assert torch.equal(buf, want)
    finally:
        for s in strangers:
            s.close()
        if worker is not None:
            worker.close()
        if sender is None and sender_call.wait(30):
            sender = sender_call.result(0)
        release_group(sender)


def test_a_sender_gone_mid_message_fails_the_receive_naming_it() -> None:
    with _pair() as (sender, receiver):
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        work = receiver.broadcast(buf)
        stream = sender.stream
        assert stream is not None
        sock = stream._lanes[(1, 0)]  # write half of message 0 (lane 0) by hand, then vanish
        sock.sendall(struct.pack("<QQ", int.from_bytes(b"wtcstrm1", "big"), 1 << 20))
        sock.sendall(bytes(1 << 19))
        t0 = time.monotonic()
        release_group(sender)
        with pytest.raises(
            TransferError, match=r"from rank 0 \(the sender\) at 127\.0\.0\.1:\d+ failed"
        ):
            wait_work(work, what="the receive", timeout_s=30)
        assert time.monotonic() - t0 < 10, "a closed connection must end the receive at once"


def test_a_stalled_sender_times_out_naming_it() -> None:
    with _pair(timeout_s=1.0) as (_, receiver):
        work = receiver.broadcast(torch.zeros(64, dtype=torch.uint8))
        with pytest.raises(TransferError, match=r"from rank 0 \(the sender\).*timed out after 1 s"):
            wait_work(work, what="the receive", timeout_s=60)


def test_a_stream_worker_on_a_gpu_is_refused_at_init() -> None:
    module = build_module({"w": torch.zeros(4)})
    engine = NCCLWorkerEngine(WeightTransferConfig("nccl"), sink=ModuleSink(module), device="cuda")
    info = NCCLInitInfo(
        master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
        transport="gloo", broadcast="stream",
    )  # fmt: skip
    with pytest.raises(PayloadError, match="init_info.broadcast: 'stream' moves CPU tensors"):
        engine.init_transfer_engine(info)
