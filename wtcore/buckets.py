"""The one bucket-boundary rule, shared by both halves of every engine (docs/protocol.md):
both compute the same buckets from the same metadata, so only raw bytes travel."""

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
    """Tensors in order at aligned offsets; one that would overflow ``buffer_size_bytes`` opens
    the next bucket. One of at least ``direct_min_bytes`` (0: none) travels alone: packing
    copies every byte twice, which gains nothing for a tensor that fills a message."""
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
    """The buckets of one round, as both ends of a bucket engine compute them."""
    if not packed:
        return per_tensor_buckets(metas)
    return plan_buckets(metas, buffer_size_bytes, direct_min_bytes=direct_min_bytes)


def max_bucket_nbytes(buckets: Sequence[Bucket]) -> int:
    return max((b.nbytes for b in buckets), default=0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (works for 0-d and empty tensors)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` into the flat ``uint8`` buffer ``out``; returns ``out[:nbytes]``. A
    non-contiguous tensor is copied through a typed view of the buffer, with no temporary."""
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
    """Iterate ``source`` once, packing each bucket into ``buffer_for(bucket)``; a bucket is
    yielded only once it (and, for the last, the whole source) matched the metadata, so a
    mismatch raises before it is announced. ``in_place(tensor)``: yield that one-tensor bucket
    as a view of the tensor."""
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
