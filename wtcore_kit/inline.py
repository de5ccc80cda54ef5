"""``inline``: the reference engine pair; each bucket travels base64-encoded in its update.

It runs the whole protocol over any client with no data plane, for tests, demos and tiny
models (slow by design). The worker refuses anything but exactly one bucket of the announced
size, so a payload cannot make it allocate more than the trainer announced at init.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore.buckets import plan_round, unpack_bucket
from wtcore.errors import PayloadError
from wtcore.parse import parse_dataclass
from wtcore.sharded.layout import is_int
from wtcore.sharded.plan import PlannedRound
from wtcore_kit.bucketed import (
    BucketedTrainerEngine,
    BucketedTrainerInitInfo,
    BucketedWorkerEngine,
    BucketUpdateInfo,
    check_bucket_options,
)
from wtcore_kit.sharded.pairs import PlanReceiver, PlanUpdate

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.sharded.plan import Chunk
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = [
    "InlineInitInfo",
    "InlineTrainerEngine",
    "InlineTrainerInitInfo",
    "InlineUpdateInfo",
    "InlineWorkerEngine",
]

DEFAULT_BUFFER_SIZE = 16 << 20


@dataclass
class InlineTrainerInitInfo(BucketedTrainerInitInfo):
    """Trainer settings of the ``inline`` engine."""

    backend: ClassVar[str] = "inline"
    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)


@dataclass
class InlineInitInfo:
    """What the worker learns at init: how both ends plan buckets."""

    packed_buffer_size_bytes: int
    packed: bool = True

    def __post_init__(self) -> None:
        check_bucket_options(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes, packed_num_buffers=1
        )


@dataclass
class InlineUpdateInfo(BucketUpdateInfo):
    """One bucket: its metadata plus the bytes, base64-encoded."""

    data: str


@dataclass
class InlinePairsInfo:
    """A sharded round's buckets for this receiver: ``{"src", "bucket", "data"}`` each."""

    buckets: list[Any]


class InlineWorkerEngine(PlanReceiver, BucketedWorkerEngine[InlineInitInfo, InlineUpdateInfo]):
    """Decodes each bucket from the payload and loads it into the sink (in a sharded round,
    assembles this receiver's pairs' buckets)."""

    init_info_cls = InlineInitInfo
    update_info_cls = InlineUpdateInfo

    def receives_after_return(self, update_info: Any) -> bool:
        return True  # the bytes come inside the update

    def parse_update_info(self, data: Mapping[str, Any]) -> Any:
        plan = self.parse_plan(data)
        if plan is not None:
            return plan
        if isinstance(data, Mapping) and "buckets" in data:
            return parse_dataclass(InlinePairsInfo, data, what="update_info")
        return super().parse_update_info(data)

    def plan_buffer_size_bytes(self) -> int:
        return self.settings.packed_buffer_size_bytes

    def _receive_pairs(self, update_info: InlinePairsInfo) -> None:
        assembler = self.planned("update_info.buckets")
        items = []
        for i, b in enumerate(update_info.buckets):
            where = f"update_info.buckets[{i}]"
            if not isinstance(b, dict) or set(b) != {"src", "bucket", "data"}:
                raise PayloadError(f"{where}: expected an object of src, bucket and data")
            if not all(is_int(b[k]) for k in ("src", "bucket")) or not isinstance(b["data"], str):
                raise PayloadError(f"{where}: src and bucket must be integers, data a string")
            items.append((b["src"], b["bucket"], _as_bytes(_decode(b["data"], f"{where}.data"))))
        assembler.take(items)

    def receive_weights(self, update_info: Any) -> None:
        if isinstance(update_info, PlanUpdate):
            self.take_plan(update_info)
            return
        if isinstance(update_info, InlinePairsInfo):
            self._receive_pairs(update_info)
            return
        self.refuse_whole_tensors()
        init = self.settings
        buckets = plan_round(
            update_info.metas, packed=init.packed, buffer_size_bytes=init.packed_buffer_size_bytes
        )
        if len(buckets) > 1:
            raise PayloadError(
                f"update_info: holds {len(buckets)} buckets' worth of tensors; the buffer size "
                f"advertised at init is {init.packed_buffer_size_bytes} bytes"
            )
        expected = buckets[0].nbytes if buckets else 0
        raw = _decode(update_info.data, "update_info.data")
        if len(raw) != expected:
            raise PayloadError(
                f"update_info.data: expected {expected} bytes for the listed tensors, "
                f"got {len(raw)}"
            )
        if not buckets:
            return
        self.sink.load_weights(list(unpack_bucket(buckets[0], _as_bytes(raw))))


def _decode(data: str, field: str) -> bytes:
    try:
        return base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise PayloadError(f"{field}: not valid base64 ({e})") from e


def _as_bytes(raw: bytes) -> torch.Tensor:
    """``raw`` as a flat ``uint8`` tensor (``frombuffer`` refuses an empty buffer)."""
    import torch

    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class InlineTrainerEngine(BucketedTrainerEngine):
    """Encodes each packed bucket into its ``update_weights`` payload."""

    init_info_cls = InlineTrainerInitInfo

    def worker_init_info(self) -> dict[str, Any]:
        return {
            "packed_buffer_size_bytes": self.info.packed_buffer_size_bytes,
            "packed": self.info.packed,
        }

    executes_plans: ClassVar[bool] = True

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Relay every rank's buckets through rank 0, one bucket per receiver per rank-indexed
        update: no receiver sees another's slice, no rank holds more than a step's buckets."""
        from wtcore.sharded.round import gather, together
        from wtcore_kit.sharded.pairs import pair_buckets

        rank, size = self.init_info.rank, self.info.packed_buffer_size_bytes
        receivers = planned.receivers[0].world_size if planned.receivers else 0
        queues: list[list[tuple[int, int, Any]]] = [[] for _ in range(receivers)]
        for s, d in planned.plan.pairs():
            for k, (bucket, chunks) in enumerate(pair_buckets(planned, s, d, size)):
                queues[d].append((s, k, (bucket, chunks)))
        # every rank takes part in each step's collectives, so a broken source is agreed on
        local = together("reading the shards", lambda: dict(source)) or {}
        stats.bytes_sent = 0
        staging = self.staging(max((b.nbytes for q in queues for _, _, (b, _) in q), default=0))
        for step in range(max((len(q) for q in queues), default=0)):

            def pack(step: int = step) -> dict[int, dict[str, Any]]:
                mine = {}
                with stats.phase("pack"):
                    for d, q in enumerate(queues):
                        if step < len(q) and q[step][0] == rank:
                            s, k, (bucket, chunks) = q[step]
                            mine[d] = self.pack_step(s, k, bucket, chunks, local, staging[0])
                            stats.num_buckets += 1
                            stats.bytes_sent += bucket.payload_nbytes
                return mine

            entries: list[dict[str, Any]] = [{"buckets": []} for _ in range(receivers)]
            for part in gather(together(f"packing step {step}", pack)):  # [] but on rank 0
                for d, item in part.items():
                    entries[d]["buckets"].append(item)

            def send(entries: list[dict[str, Any]] = entries) -> None:
                assert self.client is not None
                with stats.phase("wire"):
                    self.client.update_weights(entries)

            together(f"sending step {step}", send if rank == 0 else None)

    def pack_step(
        self,
        src: int,
        index: int,
        bucket: Bucket,
        chunks: list[Chunk],
        local: Mapping[str, torch.Tensor],
        out: torch.Tensor,
    ) -> dict[str, Any]:
        """One bucket of pair (``src``, receiver) as its entry of an update."""
        from wtcore_kit.sharded.pairs import pack_pair

        return {"src": src, "bucket": index, "data": _encode(pack_pair(bucket, chunks, local, out))}

    def send_bucket(self, bucket: Bucket, filled: torch.Tensor, slot: int) -> dict[str, Any]:
        # The payload is a copy, so the slot is free again as soon as this returns.
        return {**BucketUpdateInfo.wire(bucket.metas), "data": _encode(filled)}


def _encode(filled: torch.Tensor) -> str:
    return base64.b64encode(memoryview(filled.numpy())).decode("ascii")  # type: ignore[arg-type]
