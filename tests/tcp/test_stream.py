"""The tcp engine's streams: real TCP connections on loopback.

Rounds over worker processes are bit-exact with one and two workers (a fan-out), packed and
unpacked, with and without CRCs, and across a re-handshake. The stream's own guards are
tested on pairs whose ends run in this process (real sockets): a message of another size
than the receive posted for it is refused before a byte of it lands; strangers on the
sender's port (garbage, a wrong signature, one that connects and says nothing) are dropped
while the real worker still joins without waiting for them; a sender that disappears
mid-message, or stalls, fails the receive with an error naming it.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.nccl.nccl_e2e_kit import fleet, make_state, spec_of
from wtcore import ModuleSink, PayloadError, TensorSource, WeightTransferTrainerFactory
from wtcore.engine import WeightTransferConfig
from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.testing import build_module, wait_until
from wtcore_channel.listen import listen_on
from wtcore_channel.pipeline import wait_work
from wtcore_kit.concurrency import BackgroundCall
from wtcore_tcp import TCPInitInfo, TCPTrainerInitInfo
from wtcore_tcp.streams import HELLO_S, LANES, RELAY_CHUNK, Stream, accept, connect
from wtcore_tcp.worker import TCPWorkerEngine

pytestmark = [pytest.mark.timeout(180)]

TOKEN = "ab" * 16


@pytest.mark.parametrize("workers", [1, 2])
def test_tcp_rounds_are_bit_exact(workers: int) -> None:
    state0 = make_state(0)
    with fleet(workers, spec_of(state0), backend="tcp", options={}) as f:
        seed = 1
        for packed, checksum in ((True, False), (True, True), (False, False)):
            info = TCPTrainerInitInfo(
                address="127.0.0.1",
                world_size=1 + workers,
                timeout_s=20.0,
                packed=packed,
                checksum=checksum,
                packed_buffer_size_bytes=16 << 10,
                direct_min_bytes=4096,  # the big tensor in place, the tiny ones packed
                topology="fanout",  # the chain's rounds: test_chain_processes.py
                rank=0,
            )
            with WeightTransferTrainerFactory.trainer_init(info, client=f.client) as trainer:
                for _ in range(2):
                    state = make_state(seed)
                    seed += 1
                    version = f"tcp-{packed}-{checksum}-{seed}"
                    trainer.send_weights(TensorSource(state), weight_version=version)
                    f.assert_synced(state, version)
                trainer.handshake()  # new streams, a new port and token, the same workers
                state = make_state(seed)
                trainer.send_weights(TensorSource(state), weight_version="after-rehandshake")
                f.assert_synced(state, "after-rehandshake")


@contextmanager
def _pair(timeout_s: float = 30.0) -> Iterator[tuple[Stream, Stream]]:
    """The sender's and the worker's ends of a two-rank stream; both closed on exit."""
    listener = listen_on("127.0.0.1", 0, "the test's stream port", field="")
    port = listener.getsockname()[1]
    with listener:
        sender_call = BackgroundCall(accept, listener, world_size=2, token=TOKEN, timeout_s=30)
        worker = connect("127.0.0.1", port, rank=1, token=TOKEN, timeout_s=timeout_s)
        sender = sender_call.result(30)
    sender.timeout_s = timeout_s
    try:
        yield sender, worker
    finally:
        sender.release()
        worker.release()


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


def _closed(sock: socket.socket) -> bool:
    """The peer closed ``sock`` without a byte (a reset, when it left our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_strangers_on_the_port_are_dropped_and_hold_up_no_one() -> None:
    """Three connections that say nothing, half a hello, garbage and a hello signed with the
    wrong token, all before the real rank 1, on a handshake of 6 s: the signed-wrong and the
    garbage ones are closed without an acknowledgement, and rank 1 joins at once, without
    waiting out any stranger's hello timeout (hellos used to be read one connection at a time,
    5 s each, so three silent strangers failed the handshake)."""
    listener = listen_on("127.0.0.1", 0, "the test's stream port", field="")
    port = listener.getsockname()[1]
    strangers: list[socket.socket] = []
    sender: Stream | None = None
    worker: Stream | None = None
    with listener:
        sender_call = BackgroundCall(accept, listener, world_size=2, token=TOKEN, timeout_s=6)
        try:
            for _ in range(3):  # say nothing
                strangers.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            half = socket.create_connection(("127.0.0.1", port), timeout=10)
            half.sendall(struct.pack("<QQ", int.from_bytes(b"wtchelo1", "big"), 1))
            strangers.append(half)
            for hello in (
                b"GET / HTTP/1.0\r\n\r\n" + bytes(40),
                struct.pack("<QQQ32s", int.from_bytes(b"wtchelo1", "big"), 1, 0, b"\0" * 32),
            ):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(hello)
                strangers.append(s)
            for s in strangers[4:]:  # each was closed without an acknowledgement
                assert _closed(s)
            t0 = time.monotonic()
            worker = connect("127.0.0.1", port, rank=1, token=TOKEN, timeout_s=30)
            sender = sender_call.result(30)
            assert time.monotonic() - t0 < HELLO_S, "a silent stranger held up the worker"
            buf = torch.zeros(1000, dtype=torch.uint8)
            want = torch.arange(1000).to(torch.uint8)
            recv = worker.broadcast(buf)
            wait_work(sender.broadcast(want), what="send", timeout_s=30)
            wait_work(recv, what="receive", timeout_s=30)
            assert torch.equal(buf, want)
        finally:
            for s in strangers:
                s.close()
            if worker is not None:
                worker.release()
            if sender is None and sender_call.wait(30) and sender_call.error is None:
                sender = sender_call.result(0)
            if sender is not None:
                sender.release()


def test_a_worker_with_the_wrong_token_is_refused_naming_the_sender() -> None:
    listener = listen_on("127.0.0.1", 0, "the test's stream port", field="")
    port = listener.getsockname()[1]
    with listener:
        sender_call = BackgroundCall(accept, listener, world_size=2, token=TOKEN, timeout_s=2)
        with pytest.raises(TransferError, match=rf"the sender at 127\.0\.0\.1:{port}"):
            connect("127.0.0.1", port, rank=1, token="cd" * 16, timeout_s=30)
        assert sender_call.wait(30)
        assert isinstance(sender_call.error, TransferTimeoutError)
        assert "ranks [1] never opened" in str(sender_call.error)


def test_a_sender_gone_mid_message_fails_the_receive_naming_it() -> None:
    with _pair() as (sender, receiver):
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        work = receiver.broadcast(buf)
        sock = sender._lanes[(1, 0)]  # write half of message 0 (lane 0) by hand, then vanish
        sock.sendall(struct.pack("<QQ", int.from_bytes(b"wtcstrm1", "big"), 1 << 20))
        sock.sendall(bytes(1 << 19))
        t0 = time.monotonic()
        sender.release()
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


def test_host_staging_only_and_a_token_required_are_refused_naming_the_field() -> None:
    module = build_module({"w": torch.zeros(4)})
    engine = TCPWorkerEngine(WeightTransferConfig("tcp"), sink=ModuleSink(module), device="xpu")
    info = TCPInitInfo(address="127.0.0.1", port=1234, token=TOKEN, rank_offset=1, world_size=2)
    with pytest.raises(PayloadError, match="device: the tcp engine receives into host memory"):
        engine.init_transfer_engine(info)
    # A CUDA worker is taken: its buckets are staged in host memory (run on a GPU by
    # scripts/gpu-check.sh, bench-tcp); here only its channel's device is checked.
    cuda = TCPWorkerEngine(WeightTransferConfig("tcp"), sink=ModuleSink(module), device="cuda")
    assert cuda.channel_device == "cpu"
    with pytest.raises(PayloadError, match="^token: expected 32 to 128 lowercase hex"):
        engine.parse_init_info({**info.to_wire(), "token": ""})
    with pytest.raises(PayloadError, match="^device: the tcp engine moves CPU tensors only"):
        TCPTrainerInitInfo(address="127.0.0.1", world_size=2, rank=0, device="cuda:0")
    with pytest.raises(PayloadError, match="^port: expected a port"):
        TCPTrainerInitInfo(address="127.0.0.1", world_size=2, rank=0, port=70000)


def _tcp_pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    """``n`` connected TCP socket pairs on loopback (real sockets, no hello)."""
    pairs = []
    with listen_on("127.0.0.1", 0, "the test's pairs", field="") as listener:
        for _ in range(n):
            a = socket.create_connection(listener.getsockname()[:2], timeout=30)
            b, _ = listener.accept()
            pairs.append((a, b))
    return pairs


def test_a_relay_whose_next_rank_fails_ends_its_receive_only_once_its_bytes_are_in() -> None:
    """A relay (rank 1 of a chain) whose onward streams fail mid-message: its receive fails,
    naming rank 2, but only once the whole message has landed in its buffer. A receive that
    reported failure while bytes could still land would let the next round's data (an
    in-place sink tensor) be overwritten by the tail of an abandoned one."""
    up = {(0, lane): pair for lane, pair in enumerate(_tcp_pairs(LANES))}
    down = {(2, lane): pair for lane, pair in enumerate(_tcp_pairs(LANES))}
    lanes = {key: pair[1] for key, pair in up.items()} | {
        key: pair[0] for key, pair in down.items()
    }
    roles = ("the previous rank of the chain", "the next rank of the chain")
    relay = Stream(1, lanes, 30.0, up=0, roles=roles)
    n = 3 * RELAY_CHUNK
    sent = torch.randint(0, 256, (n,), dtype=torch.uint8)
    got = torch.zeros(n, dtype=torch.uint8)
    feed = up[(0, 0)][0]
    try:
        work = relay.broadcast(got)  # message 0: lane 0
        for _, far in down.values():
            far.close()  # rank 2 is gone
        feed.sendall(struct.pack("<QQ", int.from_bytes(b"wtcstrm1", "big"), n))
        feed.sendall(sent[:RELAY_CHUNK].numpy().tobytes())
        deadline = time.monotonic() + 30
        while work.error is None:  # the relay's onward send failed ...
            assert time.monotonic() < deadline, "the relay never noticed rank 2 was gone"
            time.sleep(0.01)
        assert "to rank 2 (the next rank of the chain)" in work.error, work.error
        assert not work.is_completed()  # ... but the rest of the message may still land
        feed.sendall(sent[RELAY_CHUNK:].numpy().tobytes())
        with pytest.raises(TransferError, match="to rank 2 \\(the next rank of the chain\\)"):
            wait_work(work, what="the relay's receive", timeout_s=30)
        assert torch.equal(got, sent)  # it ended once every byte was in
    finally:
        relay.release()
        for a, b in [*up.values(), *down.values()]:
            a.close()
            b.close()


def test_a_relay_that_refuses_a_message_says_why_on_the_message_it_was_still_handing_on() -> None:
    """A relay still writing message 0 on to rank 2 (which does not read, so the write waits)
    when message 1 arrives with another size than planned: it refuses message 1 and cuts its
    onward streams, and message 0's receive fails with that reason, not with the broken pipe
    its own cut caused (a worker records the first error of its round: here, message 0's)."""
    up = {(0, lane): pair for lane, pair in enumerate(_tcp_pairs(LANES))}
    down = {(2, lane): pair for lane, pair in enumerate(_tcp_pairs(LANES))}
    for a, _ in down.values():
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    for _, far in down.values():
        far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    lanes = {key: pair[1] for key, pair in up.items()} | {
        key: pair[0] for key, pair in down.items()
    }
    roles = ("the previous rank of the chain", "the next rank of the chain")
    relay = Stream(1, lanes, 30.0, up=0, roles=roles)
    n = 8 * RELAY_CHUNK  # far more than the socket buffers between the relay and rank 2
    sent = torch.randint(0, 256, (n,), dtype=torch.uint8)
    first, second = torch.zeros(n, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    magic = int.from_bytes(b"wtcstrm1", "big")
    try:
        works = [relay.broadcast(first), relay.broadcast(second)]  # lanes 0 and 1
        up[(0, 0)][0].sendall(struct.pack("<QQ", magic, n) + sent.numpy().tobytes())
        wait_until(lambda: works[0].recvs_left == 0, 30, "message 0 to land in the relay")
        assert works[0].sends_left  # rank 2 reads nothing: the relay's write of it waits
        up[(0, 1)][0].sendall(struct.pack("<QQ", magic, 17))  # one byte more than planned
        for work in works:
            with pytest.raises(TransferError) as exc:
                wait_work(work, what="the relay's receive", timeout_s=30)
            assert "sent 17 bytes where this receiver planned 16" in str(exc.value)
        assert torch.equal(first, sent)  # message 0 itself had landed whole
    finally:
        relay.release()
        for a, b in [*up.values(), *down.values()]:
            a.close()
            b.close()
