"""What travels on the control plane: the trainer's options, the init and the update payloads,
each checked before a byte moves."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from wtcore.buckets import Bucket, plan_round
from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore_kit.bucketed import BucketedTrainerInitInfo, BucketUpdateInfo, check_bucket_options

__all__ = [
    "DEFAULT_DIRECT_MIN_BYTES",
    "MAX_REGIONS",
    "MAX_SLOTS",
    "PROTOCOLS",
    "MooncakeInitInfo",
    "MooncakeTrainerInitInfo",
    "MooncakeUpdateInfo",
]

PROTOCOLS = ("tcp", "rdma")
MAX_SLOTS = 64
#: Tensors of a bucket read where they lie (one read each: more, smaller ones are cheaper
#: packed); also far below the 2,049 entries at which Mooncake 0.3.13's TCP batch fails.
MAX_REGIONS = 256
_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9_.:-]{1,253}):(?P<port>[0-9]{1,5})")
_ADDRESS_LIMIT = 1 << 64
#: Not the channel kit's 1 MiB: a bucket here costs a call and a read (docs/mooncake.md).
DEFAULT_DIRECT_MIN_BYTES = 64 << 20


def _check_int(value: Any, what: str, *, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise PayloadError(f"{what}: expected an int in [{low}, {high}), got {value!r:.60}")
    return value


def _check_direct(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PayloadError(f"{what}: expected an integer >= 0, got {value!r:.60}")


@dataclass
class MooncakeTrainerInitInfo(BucketedTrainerInitInfo):
    """Trainer settings of the ``mooncake`` engine (the table in docs/mooncake.md)."""

    backend: ClassVar[str] = "mooncake"
    address: str = field(default="127.0.0.1", kw_only=True)
    protocol: str = field(default="tcp", kw_only=True)
    # 128 MiB, not 64: a bucket costs ~6 ms of calls (1 GiB, 2 workers: 0.71x -> 0.89x bare)
    packed_buffer_size_bytes: int = field(default=128 << 20, kw_only=True)
    direct_min_bytes: int = field(default=DEFAULT_DIRECT_MIN_BYTES, kw_only=True)
    source_reads: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_direct(self.direct_min_bytes, "direct_min_bytes")
        if not isinstance(self.source_reads, bool):
            raise PayloadError(f"source_reads: expected a bool, got {self.source_reads!r:.40}")
        if not isinstance(self.address, str) or not self.address:
            raise PayloadError(f"address: expected a host address, got {self.address!r}")
        if self.protocol not in PROTOCOLS:
            raise PayloadError(f"protocol: expected one of {PROTOCOLS}, got {self.protocol!r}")
        if self.packed_num_buffers > MAX_SLOTS:
            raise PayloadError(f"packed_num_buffers: at most {MAX_SLOTS}")

    def plan(self, metas: Sequence[ParamMeta]) -> list[Bucket]:
        return _plan(self, metas)


@dataclass
class MooncakeInitInfo:
    """What a worker learns at init: where to read from, and the regions it may read."""

    endpoint: str  # the trainer's transfer engine, "host:port"
    slots: list[list[int]]  # [address, bytes] of each registered staging buffer
    packed_buffer_size_bytes: int
    packed: bool = True
    protocol: str = "tcp"
    timeout_s: float = 300.0
    direct_min_bytes: int = 0  # the trainer's plan: tensors this large are buckets of their own

    def __post_init__(self) -> None:
        _check_direct(self.direct_min_bytes, "init_info.direct_min_bytes")
        m = _ENDPOINT.fullmatch(self.endpoint) if isinstance(self.endpoint, str) else None
        if m is None or not 0 < int(m.group("port")) < 65536:
            raise PayloadError(f"init_info.endpoint: expected host:port, got {self.endpoint!r:.80}")
        if not isinstance(self.slots, list) or not 0 < len(self.slots) <= MAX_SLOTS:
            raise PayloadError(f"init_info.slots: expected 1 to {MAX_SLOTS} regions")
        for i, slot in enumerate(self.slots):
            if not isinstance(slot, list) or len(slot) != 2:
                raise PayloadError(f"init_info.slots[{i}]: expected [address, bytes]")
            _check_int(slot[0], f"init_info.slots[{i}] address", low=1, high=_ADDRESS_LIMIT)
            _check_int(slot[1], f"init_info.slots[{i}] bytes", low=1, high=1 << 40)
        if self.protocol not in PROTOCOLS:
            raise PayloadError(f"init_info.protocol: expected one of {PROTOCOLS}")
        check_bucket_options(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=len(self.slots),
            timeout_s=self.timeout_s,
        )

    @property
    def host(self) -> str:
        return self.endpoint.rsplit(":", 1)[0]

    def plan(self, metas: Sequence[ParamMeta]) -> list[Bucket]:
        return _plan(self, metas)


@dataclass
class MooncakeUpdateInfo(BucketUpdateInfo):
    """One bucket, packed in an announced ``slot`` (``nbytes`` long), or as ``regions``: each
    tensor's ``[address, bytes]`` in the trainer's memory. A region must be exactly its
    tensor's bytes; the trainer's engine serves only what it lent, so a forged one reads
    nothing else and lands only in that tensor's place."""

    slot: int = -1
    nbytes: int = 0
    regions: list[Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self.nbytes, "update_info.nbytes", low=0, high=1 << 40)
        if self.regions is None:
            _check_int(self.slot, "update_info.slot", low=0, high=MAX_SLOTS)
            return
        if self.slot != -1:
            raise PayloadError("update_info.slot: a bucket read from regions has no slot")
        if not isinstance(self.regions, list) or len(self.regions) != len(self.metas):
            raise PayloadError(
                f"update_info.regions: expected one [address, bytes] per tensor ({len(self.metas)})"
            )
        if len(self.regions) > MAX_REGIONS:
            raise PayloadError(f"update_info.regions: at most {MAX_REGIONS} tensors")
        for i, (r, m) in enumerate(zip(self.regions, self.metas, strict=True)):
            where = f"update_info.regions[{i}]"
            if not isinstance(r, list) or len(r) != 2:
                raise PayloadError(f"{where}: expected [address, bytes]")
            if not isinstance(r[1], int) or isinstance(r[1], bool) or r[1] != m.nbytes:
                raise PayloadError(f"{where}: {r[1]!r:.40} bytes, {m.name!r} has {m.nbytes}")
            if m.nbytes:
                _check_int(r[0], f"{where} address", low=1, high=_ADDRESS_LIMIT)


def _plan(
    info: MooncakeTrainerInitInfo | MooncakeInitInfo, metas: Sequence[ParamMeta]
) -> list[Bucket]:
    return plan_round(
        metas,
        packed=info.packed,
        buffer_size_bytes=info.packed_buffer_size_bytes,
        direct_min_bytes=info.direct_min_bytes,
    )
