"""The one bucket-boundary rule, shared by the trainer and worker halves of every engine.

Both ends compute the same buckets from the same metadata, so only raw bytes travel on the
data plane. The rule: tensors are laid out in order, each at an offset aligned to
:data:`ALIGNMENT` bytes; a tensor that would make the current bucket exceed the buffer size
closes it and opens the next; a tensor larger than the buffer travels as a bucket of its own.
An engine may also name a size (``direct_min_bytes``) from which a tensor always travels alone,
even when it would fit: packing copies every byte twice, which gains nothing for a tensor that
fills a message by itself (the nccl engine sends such tensors in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta

if TYPE_CHECKING:
    import torch

    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = [
    "ALIGNMENT",
    "Bucket",
    "align",
    "as_bytes",
    "max_bucket_nbytes",
    "pack_bucket",
    "pack_source",
    "per_tensor_buckets",
    "plan_buckets",
    "plan_round",
    "unpack_bucket",
]

#: Byte alignment of every tensor inside a bucket: enough for any dtype and for fast copies.
ALIGNMENT = 64


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Bucket:
    """A run of consecutive parameters that travel in one buffer."""

    index: int
    metas: tuple[ParamMeta, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def payload_nbytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(m.nbytes for m in self.metas)


def plan_buckets(
    metas: Sequence[ParamMeta], buffer_size_bytes: int, *, direct_min_bytes: int = 0
) -> list[Bucket]:
    """Split ``metas`` into buckets of at most ``buffer_size_bytes`` (see module docstring);
    every tensor of at least ``direct_min_bytes`` bytes (0: none) is a bucket of its own."""
    if buffer_size_bytes <= 0:
        raise PayloadError(f"buffer_size_bytes must be positive, got {buffer_size_bytes}")
    buckets: list[Bucket] = []
    cur: list[ParamMeta] = []
    offsets: list[int] = []
    end = 0

    def close() -> None:
        nonlocal cur, offsets, end
        buckets.append(Bucket(len(buckets), tuple(cur), tuple(offsets), end))
        cur, offsets, end = [], [], 0

    for m in metas:
        alone = 0 < direct_min_bytes <= m.nbytes
        start = align(end)
        if cur and (alone or start + m.nbytes > buffer_size_bytes):
            close()
            start = 0
        cur.append(m)
        offsets.append(start)
        end = start + m.nbytes
        if alone:
            close()
    if cur:
        close()
    return buckets


def per_tensor_buckets(metas: Sequence[ParamMeta]) -> list[Bucket]:
    """Unpacked mode: every tensor is a bucket of its own, at offset 0."""
    return [Bucket(i, (m,), (0,), m.nbytes) for i, m in enumerate(metas)]


def plan_round(
    metas: Sequence[ParamMeta], *, packed: bool, buffer_size_bytes: int, direct_min_bytes: int = 0
) -> list[Bucket]:
    """The buckets of one round, as both ends of a bucket engine compute them.

    ``direct_min_bytes`` (packed only; 0: none): tensors of at least that size travel alone.
    """
    if not packed:
        return per_tensor_buckets(metas)
    return plan_buckets(metas, buffer_size_bytes, direct_min_bytes=direct_min_bytes)


def max_bucket_nbytes(buckets: Sequence[Bucket]) -> int:
    """The receive/staging buffer size that fits every bucket."""
    return max((b.nbytes for b in buckets), default=0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (works for 0-d and empty tensors)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` into the flat ``uint8`` buffer ``out``; returns ``out[:nbytes]``.

    A tensor need not be contiguous (a region of a shard, say): it is copied straight into
    its place, through a view of the buffer in its own dtype and shape, with no temporary.
    """
    if len(tensors) != len(bucket.metas):
        raise PayloadError(
            f"bucket {bucket.index} holds {len(bucket.metas)} tensors, got {len(tensors)}"
        )
    if out.numel() < bucket.nbytes:
        raise PayloadError(
            f"buffer of {out.numel()} bytes is too small for bucket of {bucket.nbytes}"
        )
    for meta, off, t in zip(bucket.metas, bucket.offsets, tensors, strict=True):
        if not meta.nbytes:
            continue
        if t.is_contiguous():
            out[off : off + meta.nbytes].copy_(as_bytes(t))
        else:
            out[off : off + meta.nbytes].view(t.dtype).view(t.shape).copy_(t)
    return out[: bucket.nbytes]


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor inside the flat ``uint8`` buffer ``buf`` (no copies)."""
    if buf.numel() < bucket.nbytes:
        raise PayloadError(
            f"buffer of {buf.numel()} bytes is too small for bucket of {bucket.nbytes}"
        )
    for meta, off in zip(bucket.metas, bucket.offsets, strict=True):
        raw = buf[off : off + meta.nbytes]
        yield meta.name, raw.view(meta.dtype).reshape(meta.shape)


def pack_source(
    source: WeightSource,
    metas: Sequence[ParamMeta],
    buckets: Sequence[Bucket],
    buffer_for: Callable[[Bucket], torch.Tensor],
    stats: TransferStats | None = None,
    *,
    in_place: Callable[[torch.Tensor], bool] | None = None,
) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Iterate ``source`` once, packing each bucket into ``buffer_for(bucket)`` as it goes.

    Yields ``(bucket, filled_bytes)`` only once every tensor of the bucket matched its
    metadata, and checks that the source holds nothing more before yielding the last bucket,
    so a mismatch is always raised before the affected bucket is announced to any receiver.
    Tensors are copied one by one, so at most one materialized tensor is alive at a time.
    With ``in_place``, a bucket of one tensor for which ``in_place(tensor)`` holds is yielded
    as a flat view of that tensor itself (no copy, ``buffer_for`` not called).
    """
    from wtcore.source import iter_checked
    from wtcore.stats import TransferStats

    st = stats if stats is not None else TransferStats()
    it = iter_checked(source, metas)
    for i, bucket in enumerate(buckets):
        first = None
        if in_place is not None and len(bucket.metas) == 1 and bucket.nbytes:
            with st.phase("materialize"):
                first = next(it)
            if in_place(first[1]):
                if i == len(buckets) - 1:
                    _exhaust(it)
                yield bucket, as_bytes(first[1])
                continue
        buf = buffer_for(bucket)
        if buf.numel() < bucket.nbytes:
            raise PayloadError(
                f"buffer of {buf.numel()} bytes is too small for bucket of {bucket.nbytes}"
            )
        for off in bucket.offsets:
            if first is not None:
                (meta, t), first = first, None
            else:
                with st.phase("materialize"):
                    meta, t = next(it)
            if meta.nbytes:
                with st.phase("pack"):
                    buf[off : off + meta.nbytes].copy_(as_bytes(t))
            del t
        if i == len(buckets) - 1:
            _exhaust(it)
        yield bucket, buf[: bucket.nbytes]
    if not buckets:
        _exhaust(it)


def _exhaust(it: Iterator[object]) -> None:
    for _ in it:  # iter_checked raises on an extra item, or on a short source
        pass
