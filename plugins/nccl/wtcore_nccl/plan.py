"""The round plan of the nccl engine, and the sender's frames: large tensors travel as they are.

Packing copies every byte twice (into the sender's buffer, out of the receiver's), and on a
small host those copies compete with the transport for the same cores. A tensor large enough
to fill a broadcast on its own gains nothing from packing, so the plan gives every tensor of
at least ``direct_min_bytes`` a bucket of its own; small tensors are still packed (one
broadcast each would cost more in per-message overhead than the copy). Both ends compute the
plan from the update's metadata and ``direct_min_bytes`` (shipped in the init info), so only
raw bytes travel.

Whether a single-tensor bucket is then sent and received *in place* is each end's own choice,
invisible on the wire: the sender broadcasts straight from the source tensor when it is on the
group's device (else it stages it), and the receiver receives straight into the tensor its
sink offers (:func:`wtcore.sink.direct_destination`), else into a buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from wtcore.buckets import Bucket, as_bytes, plan_buckets, plan_round
from wtcore.errors import PayloadError
from wtcore.sink import on_device
from wtcore.source import iter_checked

if TYPE_CHECKING:
    import torch

    from wtcore.meta import ParamMeta
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = ["is_single", "iter_frames", "plan_nccl"]


def plan_nccl(
    metas: Sequence[ParamMeta], *, packed: bool, buffer_size_bytes: int, direct_min_bytes: int
) -> list[Bucket]:
    """The buckets of one round: :func:`wtcore.buckets.plan_round`, except that (packed) every
    tensor of at least ``direct_min_bytes`` bytes (0: none) travels as a bucket of its own."""
    if not packed or direct_min_bytes <= 0:
        return plan_round(metas, packed=packed, buffer_size_bytes=buffer_size_bytes)
    buckets: list[Bucket] = []
    run: list[ParamMeta] = []

    def flush() -> None:
        for b in plan_buckets(run, buffer_size_bytes):
            buckets.append(Bucket(len(buckets), b.metas, b.offsets, b.nbytes))
        run.clear()

    for m in metas:
        if m.nbytes >= direct_min_bytes:
            flush()
            buckets.append(Bucket(len(buckets), (m,), (0,), m.nbytes))
        else:
            run.append(m)
    flush()
    return buckets


def is_single(bucket: Bucket) -> bool:
    """A bucket of exactly one tensor (at offset 0): its bytes are that tensor's bytes."""
    return len(bucket.metas) == 1


def iter_frames(
    source: WeightSource,
    metas: Sequence[ParamMeta],
    buckets: Sequence[Bucket],
    *,
    buffer_for: Callable[[Bucket], torch.Tensor],
    device: str,
    stats: TransferStats,
) -> Iterator[tuple[Bucket, torch.Tensor, bool]]:
    """Iterate ``source`` once, yielding ``(bucket, bytes, staged)`` for every bucket.

    A single-tensor bucket whose tensor is on ``device`` is yielded as a flat view of that
    tensor (``staged`` False: no copy; the caller keeps the tensor alive until its broadcast
    ends); every other bucket is packed into ``buffer_for(bucket)``. As in
    :func:`wtcore.buckets.pack_source`, each tensor is checked against its metadata, and the
    source is checked to hold nothing more before the last bucket is yielded, so a mismatch is
    raised before the affected bucket is announced.
    """
    import torch

    empty = torch.empty(0, dtype=torch.uint8)
    it = iter_checked(source, metas)
    last = len(buckets) - 1
    for i, bucket in enumerate(buckets):
        if bucket.nbytes == 0:  # only empty tensors: nothing travels
            for _ in bucket.metas:
                with stats.phase("materialize"):
                    next(it)
            data, staged = empty, False
        elif is_single(bucket):
            with stats.phase("materialize"):
                _, t = next(it)
            t = t.detach()
            if on_device(t, device):
                data, staged = as_bytes(t), False
            else:  # another device: stage it
                buf = buffer_for(bucket)
                _check_room(bucket, buf)
                with stats.phase("pack"):
                    buf[: bucket.nbytes].copy_(as_bytes(t))
                data, staged = buf[: bucket.nbytes], True
            del t
        else:
            buf = buffer_for(bucket)
            _check_room(bucket, buf)
            for off, meta in zip(bucket.offsets, bucket.metas, strict=True):
                with stats.phase("materialize"):
                    _, t = next(it)
                if meta.nbytes:
                    with stats.phase("pack"):
                        buf[off : off + meta.nbytes].copy_(as_bytes(t))
                del t
            data, staged = buf[: bucket.nbytes], True
        if i == last:
            _exhaust(it)
        yield bucket, data, staged
    if not buckets:
        _exhaust(it)


def _check_room(bucket: Bucket, buf: torch.Tensor) -> None:
    if buf.numel() < bucket.nbytes:
        raise PayloadError(
            f"buffer of {buf.numel()} bytes is too small for bucket of {bucket.nbytes}"
        )


def _exhaust(it: Iterator[object]) -> None:
    for _ in it:  # iter_checked raises on an extra item, or on a short source
        pass
