"""The nccl engine's buffer pool: how many messages may be in flight, and what it holds."""

from __future__ import annotations

import torch

from wtcore.buckets import Bucket
from wtcore.meta import ParamMeta
from wtcore_channel.pipeline import BufferPool

MIB = 1 << 20


def _bucket(index: int, nbytes: int) -> Bucket:
    meta = ParamMeta(f"t{index}", torch.uint8, (nbytes,))
    return Bucket(index=index, metas=(meta,), offsets=(0,), nbytes=nbytes)


def test_num_buffers_messages_always_fit_whatever_their_size() -> None:
    pool = BufferPool(num_buffers=2, buffer_size=4 * MIB)
    assert pool.has_room(0, 0) and pool.has_room(1, 100 * MIB)
    assert not pool.has_room(2, 100 * MIB)  # past two, a huge tensor in place is the limit


def test_tensors_in_place_go_in_flight_up_to_what_the_ring_would_hold() -> None:
    pool = BufferPool(num_buffers=2, buffer_size=4 * MIB)
    held, in_flight = 0, 0
    while pool.has_room(in_flight, held):
        held += MIB  # one more 1 MiB tensor sent (or received) in place
        in_flight += 1
    assert in_flight == 8 and held == 8 * MIB  # 2 x 4 MiB, not 2 messages


def test_the_pools_own_buffers_count_against_the_same_budget() -> None:
    pool = BufferPool(num_buffers=2, buffer_size=4 * MIB)
    pool.prepare([_bucket(0, 3 * MIB)])
    pool.slot_for(_bucket(0, 3 * MIB))  # the ring is allocated: 2 x 3 MiB
    assert pool.nbytes() == 6 * MIB
    assert pool.has_room(2, MIB) and not pool.has_room(2, 2 * MIB)
