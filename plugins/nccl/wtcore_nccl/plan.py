"""The round plan of the nccl engine: large tensors travel as they are, in buckets of their own.

Packing copies every byte twice (into the sender's buffer, out of the receiver's), and on a
small host those copies compete with the transport for the same cores. A tensor large enough
to fill a broadcast on its own gains nothing from packing, so the plan gives every tensor of
at least ``direct_min_bytes`` a bucket of its own; small tensors are still packed (one
broadcast each would cost more in per-message overhead than the copy). Both ends compute the
plan from the update's metadata and ``direct_min_bytes`` (shipped in the init info), so only
raw bytes travel. The rule itself is the core's one (``direct_min_bytes`` of
:func:`wtcore.buckets.plan_round`); this module names it for the nccl engine.

Whether a single-tensor bucket is then sent and received *in place* is each end's own choice,
invisible on the wire: the sender broadcasts straight from the source tensor when it is on the
group's device (``wtcore.buckets.pack_source(in_place=...)``; else it stages it), and the
receiver receives straight into the tensor its sink offers
(:func:`wtcore.sink.direct_destination`), else into a buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from wtcore.buckets import Bucket, plan_round

if TYPE_CHECKING:
    from wtcore.meta import ParamMeta

__all__ = ["is_single", "plan_nccl"]


def plan_nccl(
    metas: Sequence[ParamMeta], *, packed: bool, buffer_size_bytes: int, direct_min_bytes: int
) -> list[Bucket]:
    """The buckets of one round: :func:`wtcore.buckets.plan_round`, where (packed) every
    tensor of at least ``direct_min_bytes`` bytes (0: none) travels as a bucket of its own."""
    return plan_round(
        metas, packed=packed, buffer_size_bytes=buffer_size_bytes, direct_min_bytes=direct_min_bytes
    )


def is_single(bucket: Bucket) -> bool:
    """A bucket of exactly one tensor (at offset 0): its bytes are that tensor's bytes."""
    return len(bucket.metas) == 1
