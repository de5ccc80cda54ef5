"""A packed bucket as a list of tensors: what a channel that gathers sends, and scatters into.

Packing copies cost a streamed round more CPU than its framing, so a channel that takes a
message in pieces (:class:`PartsChannel`) gets the tensors in order, the alignment gaps as
pieces of a pad: the wire carries exactly a packed bucket's bytes, so either end may pack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from wtcore.buckets import ALIGNMENT, Bucket, as_bytes, pack_source, per_tensor_buckets
from wtcore_channel.pipeline import Channel, Work

if TYPE_CHECKING:
    import torch

    from wtcore.meta import ParamMeta
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = ["PartsChannel", "bucket_parts", "gather_source", "new_pad", "parts_of"]


class PartsChannel(Channel, Protocol):
    """A channel that may send one message from, or receive it into, several tensors."""

    def broadcast_parts(self, tensors: Sequence[torch.Tensor]) -> Work:
        """:meth:`Channel.broadcast` for the bytes of ``tensors`` in order."""
        ...


def parts_of(channel: Channel) -> PartsChannel | None:
    """``channel``, if it takes a message in parts; else ``None`` (pack the bucket). Not
    ``isinstance``: that walks the protocol's members on every call, once a bucket."""
    return cast("PartsChannel", channel) if hasattr(channel, "broadcast_parts") else None


def new_pad(device: str) -> torch.Tensor:
    """Zeros for the gaps between a bucket's tensors (a receiver writes and drops them)."""
    import torch

    return torch.zeros(ALIGNMENT, dtype=torch.uint8, device=device)


def bucket_parts(
    bucket: Bucket, tensors: Sequence[torch.Tensor], pad: torch.Tensor
) -> list[torch.Tensor]:
    """``bucket``'s bytes as flat ``uint8`` views of ``tensors`` and of ``pad`` for the gaps."""
    parts: list[torch.Tensor] = []
    at = 0
    for meta, off, t in zip(bucket.metas, bucket.offsets, tensors, strict=True):
        parts += _gap(pad, off - at)
        parts.append(as_bytes(t))
        at = off + meta.nbytes
    parts += _gap(pad, bucket.nbytes - at)
    return parts


def _gap(pad: torch.Tensor, n: int) -> list[torch.Tensor]:
    step = pad.numel()
    return [pad[: min(step, n - at)] for at in range(0, n, step)]


def gather_source(
    source: WeightSource,
    metas: Sequence[ParamMeta],
    buckets: Sequence[Bucket],
    buffer_for: Callable[[Bucket], torch.Tensor],
    stats: TransferStats,
    *,
    in_place: Callable[[torch.Tensor], bool],
    pad: torch.Tensor,
) -> Iterator[tuple[Bucket, torch.Tensor | list[torch.Tensor], int]]:
    """``pack_source`` for a channel that takes parts: every bucket without a packing copy.

    Yields ``(bucket, data, packed)``: one tensor as ``pack_source`` yields it, or the parts of
    several, and the bytes packed into ``buffer_for(bucket)`` (a tensor ``in_place`` refuses
    is packed there at its own offset). A bucket is yielded once all its tensors were checked.
    """
    owner = [(b, k) for b in buckets for k in range(len(b.metas))]
    buffers: dict[int, torch.Tensor] = {}
    packed = 0

    def region_for(one: Bucket) -> torch.Tensor:
        nonlocal packed
        if not one.nbytes:
            return pad[:0]
        bucket, k = owner[one.index]
        if bucket.index not in buffers:  # one buffer a bucket, asked for once
            buffers[bucket.index] = buffer_for(bucket)
        packed += one.nbytes
        return buffers[bucket.index][bucket.offsets[k] :]

    held: list[torch.Tensor] = []
    singles = per_tensor_buckets(metas)
    for one, data in pack_source(source, metas, singles, region_for, stats, in_place=in_place):
        bucket, k = owner[one.index]
        held.append(data)
        if k < len(bucket.metas) - 1:
            continue
        yield bucket, held[0] if len(held) == 1 else bucket_parts(bucket, held, pad), packed
        held, packed = [], 0
        buffers.pop(bucket.index, None)
