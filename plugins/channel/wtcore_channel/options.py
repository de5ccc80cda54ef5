"""The options of a streamed engine, and the round's plan both ends compute from them, so
only raw bytes (and frame headers) travel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from wtcore.buckets import Bucket, plan_round
from wtcore.errors import PayloadError
from wtcore_kit.bucketed import BucketedTrainerInitInfo, BucketUpdateInfo, check_bucket_options

if TYPE_CHECKING:
    from wtcore.meta import ParamMeta

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_DIRECT_MIN_BYTES",
    "ChannelSettings",
    "ChannelTrainerInitInfo",
    "ChannelUpdateInfo",
    "PlanOptions",
    "check_direct",
    "check_receiver_settings",
    "plan",
]

#: 1 GiB made a 1 GiB model one unpipelined bucket; 32-256 MiB measured alike.
DEFAULT_BUFFER_SIZE = 64 << 20
DEFAULT_DIRECT_MIN_BYTES = 1 << 20


def check_direct(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PayloadError(f"direct_min_bytes: expected an integer >= 0, got {value!r}")


@dataclass
class ChannelTrainerInitInfo(BucketedTrainerInitInfo, abstract=True):
    """The options of every streamed engine, besides the kit's bucket options.

    ``direct_min_bytes``: a tensor at least this large travels alone, in place where both ends
    allow (0 packs everything). ``checksum``: a CRC-32 in every frame header; receivers then
    stage and verify every bucket before applying it.
    """

    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)
    device: str = field(default="cpu", kw_only=True)
    direct_min_bytes: int = field(default=DEFAULT_DIRECT_MIN_BYTES, kw_only=True)
    checksum: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_direct(self.direct_min_bytes)
        if not isinstance(self.checksum, bool):
            raise PayloadError(f"checksum: expected a bool, got {self.checksum!r}")

    def receiver_settings(self) -> dict[str, Any]:
        """What every receiver's init info carries of these options (none can be left out)."""
        return {
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
            "timeout_s": self.timeout_s,
            "direct_min_bytes": self.direct_min_bytes,
            "checksum": self.checksum,
        }


class PlanOptions(Protocol):
    """What the plan reads: the trainer's options, and a receiver's init info alike."""

    packed: bool
    packed_buffer_size_bytes: int
    direct_min_bytes: int


class ChannelSettings(Protocol):
    """A receiver's init info: the bucket options, and its channel rank ``rank_offset + worker
    rank`` of ``world_size`` (rank 0 is the sender)."""

    rank_offset: int
    world_size: int

    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    timeout_s: float
    direct_min_bytes: int
    checksum: bool


@dataclass
class ChannelUpdateInfo(BucketUpdateInfo):
    """All tensors of one round, in order; the bytes travel on the channel."""


def plan(metas: list[ParamMeta], settings: PlanOptions) -> list[Bucket]:
    """The round's buckets: a tensor of at least ``direct_min_bytes`` travels alone."""
    return plan_round(
        metas,
        packed=settings.packed,
        buffer_size_bytes=settings.packed_buffer_size_bytes,
        direct_min_bytes=settings.direct_min_bytes,
    )


def check_receiver_settings(settings: ChannelSettings) -> None:
    """Check :meth:`ChannelTrainerInitInfo.receiver_settings` on the receiver's side."""
    if not isinstance(settings.rank_offset, int) or settings.rank_offset < 1:
        raise PayloadError(
            f"rank_offset: expected at least 1 (rank 0 is the sender), got {settings.rank_offset!r}"
        )
    check_direct(settings.direct_min_bytes)
    if not isinstance(settings.checksum, bool):
        raise PayloadError(f"checksum: expected a bool, got {settings.checksum!r}")
    check_bucket_options(
        packed_buffer_size_bytes=settings.packed_buffer_size_bytes,
        packed_num_buffers=settings.packed_num_buffers,
        timeout_s=settings.timeout_s,
    )
