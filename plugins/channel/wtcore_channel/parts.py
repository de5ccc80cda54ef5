"""A packed bucket as a list of tensors: what a channel that gathers sends, and scatters into.

A packed bucket is its tensors' bytes at aligned offsets in one buffer. Copying them into that
buffer on the sender, and out of it on every receiver, cost a streamed round on a small host
more CPU than its framing (three copies of every packed byte over two receivers, on cores the
sockets' own copies already keep busy). A channel whose messages may be several pieces of
memory (:class:`PartsChannel`: a TCP stream, with ``sendmsg`` and ``recvmsg_into``) moves the
same bytes without the buffer: :func:`bucket_parts` lists the tensors in order, with the
alignment gaps between them as pieces of a small pad, so the wire carries exactly what a
packed bucket would and either end may pack while the other does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from wtcore.buckets import ALIGNMENT, Bucket, as_bytes
from wtcore_channel.pipeline import Channel, Work

if TYPE_CHECKING:
    import torch

__all__ = ["PartsChannel", "bucket_parts", "new_pad", "parts_of"]


@runtime_checkable
class PartsChannel(Channel, Protocol):
    """A channel that may send one message from, or receive it into, several tensors."""

    @property
    def takes_parts(self) -> bool:
        """Whether :meth:`broadcast_parts` works now (a channel that wraps several data
        planes takes parts only on those that do)."""
        ...

    def broadcast_parts(self, tensors: Sequence[torch.Tensor]) -> Work:
        """Like :meth:`Channel.broadcast` for the bytes of ``tensors`` in order (contiguous
        tensors on the channel's device; empty ones take no bytes)."""
        ...


def parts_of(channel: Channel) -> PartsChannel | None:
    """``channel``, if it takes a message in parts now; else ``None`` (pack the bucket)."""
    return channel if isinstance(channel, PartsChannel) and channel.takes_parts else None


def new_pad(device: str) -> torch.Tensor:
    """Zeros for the gaps between a bucket's tensors (a receiver writes them and drops them)."""
    import torch

    return torch.zeros(ALIGNMENT, dtype=torch.uint8, device=device)


def bucket_parts(
    bucket: Bucket, tensors: Sequence[torch.Tensor], pad: torch.Tensor
) -> list[torch.Tensor]:
    """``bucket``'s bytes as flat ``uint8`` views of ``tensors`` (contiguous, one per tensor
    of the bucket, in order) and of ``pad`` for the gaps, ``bucket.nbytes`` in all."""
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
