"""Messages in parts: a packed bucket's bytes sent from its tensors and received into them.

The wire carries exactly what a packed bucket would (``wtcore_channel.parts``), so an end that
moves parts talks to one that packs; these run on real TCP connections on loopback, both ends
in this process. A message of parts whose total disagrees with the sender's is refused before
a byte of it lands, and more parts than one ``sendmsg`` or ``recvmsg_into`` takes still arrive
whole and in order, also through a relay. The trainer's side reads its source as packing
would, with the same checks, and packs only what may not travel from where it lies.
"""

from __future__ import annotations

import pytest
import torch

from tests.tcp.test_stream import _pair, _tcp_pairs
from wtcore import TensorSource
from wtcore.buckets import ALIGNMENT, Bucket, as_bytes, pack_bucket, plan_buckets
from wtcore.errors import PayloadError, TransferError
from wtcore.meta import ParamMeta
from wtcore.stats import TransferStats
from wtcore_channel.parts import bucket_parts, gather_source, new_pad
from wtcore_channel.pipeline import wait_work
from wtcore_tcp.streams import _IOV, LANES, Stream

pytestmark = [pytest.mark.timeout(120)]


def _bytes(*sizes: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


def _wait(*works: object) -> None:
    for w in works:
        wait_work(w, what="a message", timeout_s=30)  # type: ignore[arg-type]


def test_bucket_parts_are_the_packed_bucket_byte_for_byte() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(3, generator=g),  # 12 bytes: a gap of 52 after it
        torch.zeros(0),  # no bytes, and no gap
        torch.randn(5, 7, generator=g).to(torch.bfloat16),
        torch.randint(0, 9, (1,), generator=g),
    ]
    metas = [ParamMeta.of(f"t{i}", t) for i, t in enumerate(tensors)]
    (bucket,) = plan_buckets(metas, 1 << 20)
    packed = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, tensors, packed)
    pad = new_pad("cpu")
    parts = bucket_parts(bucket, tensors, pad)
    assert sum(p.numel() for p in parts) == bucket.nbytes
    gaps = [p.numel() for p in parts if p.data_ptr() == pad.data_ptr()]  # views of the pad
    assert gaps == [ALIGNMENT - 12, ALIGNMENT - 70 % ALIGNMENT], (gaps, bucket)
    assert torch.equal(torch.cat(parts), packed)


@pytest.mark.parametrize("count", [3, _IOV + 37], ids=["few", "more-than-one-call"])
def test_parts_sent_are_one_message_and_one_message_lands_in_parts(count: int) -> None:
    sizes = [1 + (i * 7919) % 5000 for i in range(count)]
    sizes[1] = 0  # an empty part takes no bytes
    sent = _bytes(*sizes, seed=count)
    with _pair() as (sender, receiver):
        whole = torch.zeros(sum(sizes), dtype=torch.uint8)
        scattered = [torch.zeros_like(t) for t in sent]
        recvs = [receiver.broadcast(whole), receiver.broadcast_parts(scattered)]
        sends = [sender.broadcast_parts(sent), sender.broadcast(torch.cat(sent))]
        _wait(*sends, *recvs)
        assert torch.equal(whole, torch.cat(sent))
        for a, b in zip(sent, scattered, strict=True):
            assert torch.equal(a, b)


def test_parts_of_another_total_are_refused_before_a_byte_lands() -> None:
    with _pair() as (sender, receiver):
        parts = [torch.zeros(40, dtype=torch.uint8), torch.zeros(24, dtype=torch.uint8)]
        work = receiver.broadcast_parts(parts)
        sender.broadcast_parts(_bytes(60, 40))
        with pytest.raises(TransferError, match="sent 100 bytes where this receiver planned 64"):
            wait_work(work, what="the receive", timeout_s=30)
        assert all(not p.any() for p in parts)  # nothing of it landed


def test_a_relay_receives_in_parts_and_hands_on_the_same_bytes() -> None:
    """Rank 1 relays a message it receives in parts (more than one call takes, a part larger
    than a relay's piece among them) to rank 2, which receives it whole."""
    up = {(0, lane): pair for lane, pair in enumerate(_tcp_pairs(LANES))}
    down = {(2, lane): pair for lane, pair in enumerate(_tcp_pairs(LANES))}
    roles = ("the previous rank of the chain", "the next rank of the chain")
    sender = Stream(0, {(1, lane): pair[0] for (_, lane), pair in up.items()}, 30.0, up=None)
    relay_lanes = {key: pair[1] for key, pair in up.items()}
    relay = Stream(1, relay_lanes | {key: pair[0] for key, pair in down.items()}, 30.0, up=0,
                   roles=roles)  # fmt: skip
    last = Stream(2, {(1, lane): pair[1] for (_, lane), pair in down.items()}, 30.0, up=1)
    sent = _bytes(*([3] * (_IOV + 5)), 3 << 20, 11)
    try:
        at_relay = [torch.zeros_like(t) for t in sent]
        at_last = torch.zeros(sum(t.numel() for t in sent), dtype=torch.uint8)
        works = [last.broadcast(at_last), relay.broadcast_parts(at_relay)]
        works.append(sender.broadcast(torch.cat(sent)))
        _wait(*works)
        for want, got in zip(sent, at_relay, strict=True):
            assert torch.equal(want, got)
        assert torch.equal(at_last, torch.cat(sent))
    finally:
        for s in (sender, relay, last):
            s.release()
        for a, b in [*up.values(), *down.values()]:
            a.close()
            b.close()


def test_gather_source_yields_each_bucket_whole_without_packing_what_it_may_send_in_place() -> None:
    """The trainer's side: a bucket of several tensors comes as its parts, straight from the
    source's tensors; one that may not travel in place (a CUDA tensor for a CPU channel, here
    refused by name) is packed into the bucket's buffer at its own offset, and only that."""
    g = torch.Generator().manual_seed(3)
    state = {
        "a": torch.randn(5, generator=g),
        "b": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "c": torch.zeros(0),
        "d": torch.randn(300, generator=g),  # alone (direct)
        "e": torch.randint(0, 9, (2,), generator=g),
    }
    source = TensorSource(state)
    metas = source.metadata()
    buckets = plan_buckets(metas, 1 << 10, direct_min_bytes=1024)
    assert [len(b.metas) for b in buckets] == [3, 1, 1]
    asked: list[int] = []
    buffers = {b.index: torch.zeros(b.nbytes, dtype=torch.uint8) for b in buckets}

    def buffer_for(bucket: Bucket) -> torch.Tensor:
        asked.append(bucket.index)
        return buffers[bucket.index]

    refused = state["b"]
    frames = list(
        gather_source(
            source, metas, buckets, buffer_for, TransferStats(),
            in_place=lambda t: t.data_ptr() != refused.data_ptr(), pad=new_pad("cpu"),
        )
    )  # fmt: skip
    assert asked == [0]  # once, for the bucket of the refused tensor
    (b0, parts, packed0), (_, d, packed1), (_, e, packed2) = frames
    assert isinstance(parts, list) and packed0 == refused.numel() * 2 and packed1 == packed2 == 0
    want = torch.zeros(b0.nbytes, dtype=torch.uint8)
    pack_bucket(b0, [state["a"], state["b"], state["c"]], want)
    assert torch.equal(torch.cat(parts), want)
    assert parts[0].data_ptr() == state["a"].data_ptr()  # sent from the source itself
    assert isinstance(d, torch.Tensor) and d.data_ptr() == state["d"].data_ptr()
    assert isinstance(e, torch.Tensor) and torch.equal(e, as_bytes(state["e"]))


def test_gather_source_refuses_a_mismatch_before_yielding_the_bucket_it_is_in() -> None:
    state = {"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(400)}
    metas = TensorSource(state).metadata()
    buckets = plan_buckets(metas, 1 << 10, direct_min_bytes=1024)
    bad = TensorSource({**state, "b": torch.ones(5)})
    frames = gather_source(
        bad, metas, buckets, lambda b: torch.zeros(b.nbytes, dtype=torch.uint8),
        TransferStats(), in_place=lambda t: True, pad=new_pad("cpu"),
    )  # fmt: skip
    with pytest.raises(PayloadError, match="'b'"):
        next(frames)
