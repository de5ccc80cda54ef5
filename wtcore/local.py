"""``local``: the reference engine pair, and the template for plugin authors.

The data travels *inside* the control-plane payload, base64-encoded, one bucket per
``update_weights`` call. That makes it the simplest engine that runs the whole protocol over
any client (in-process, HTTP, Ray) with no data plane to set up. It is meant for tests, demos
and tiny models: every byte is copied through JSON, so it is slow by design.

The two halves share one bucket rule (:func:`wtcore.buckets.plan_buckets`): the worker
re-plans each update's metadata and refuses anything but exactly one bucket of the advertised
size, so a payload cannot make it allocate more than the trainer announced at init.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore.buckets import max_bucket_nbytes, pack_source, plan_buckets, unpack_bucket
from wtcore.engine import WeightTransferEngine
from wtcore.errors import PayloadError, ProtocolStateError
from wtcore.meta import ParamMeta, metas_from_wire, metas_to_wire
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

if TYPE_CHECKING:
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = [
    "LocalInitInfo",
    "LocalTrainerEngine",
    "LocalTrainerInitInfo",
    "LocalUpdateInfo",
    "LocalWorkerEngine",
]

DEFAULT_BUFFER_SIZE = 16 << 20


@dataclass
class LocalTrainerInitInfo(TrainerInitInfo):
    """Trainer settings of the ``local`` engine."""

    backend: ClassVar[str] = "local"
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.buffer_size_bytes <= 0:
            raise ValueError(f"buffer_size_bytes: must be positive, got {self.buffer_size_bytes}")


@dataclass
class LocalInitInfo:
    """What the worker learns at init: the bucket size both ends plan with."""

    buffer_size_bytes: int

    def __post_init__(self) -> None:
        if self.buffer_size_bytes <= 0:
            raise ValueError(f"buffer_size_bytes: must be positive, got {self.buffer_size_bytes}")


@dataclass
class LocalUpdateInfo:
    """One bucket: its metadata (DESIGN §4 names) plus the bytes, base64-encoded."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    data: str
    metas: list[ParamMeta] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.metas = metas_from_wire(self.names, self.dtype_names, self.shapes)


class LocalWorkerEngine(WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
    """Decodes each bucket from the payload and loads it into the sink."""

    init_info_cls = LocalInitInfo
    update_info_cls = LocalUpdateInfo

    _init: LocalInitInfo | None = None

    def init_transfer_engine(self, init_info: LocalInitInfo) -> None:
        self._init = init_info

    def receive_weights(self, update_info: LocalUpdateInfo) -> None:
        import torch

        if self._init is None:
            raise ProtocolStateError("local engine: init_transfer_engine was not called")
        buckets = plan_buckets(update_info.metas, self._init.buffer_size_bytes)
        if len(buckets) > 1:
            raise PayloadError(
                f"update_info: holds {len(buckets)} buckets' worth of tensors; the buffer size "
                f"advertised at init is {self._init.buffer_size_bytes} bytes"
            )
        expected = max_bucket_nbytes(buckets)
        try:
            raw = base64.b64decode(update_info.data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise PayloadError(f"update_info.data: not valid base64 ({e})") from e
        if len(raw) != expected:
            raise PayloadError(
                f"update_info.data: expected {expected} bytes for the listed tensors, "
                f"got {len(raw)}"
            )
        if not buckets:
            return
        buf = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        self.sink.load_weights(list(unpack_bucket(buckets[0], buf)))


class LocalTrainerEngine(TrainerWeightTransferEngine):
    """Packs buckets into one reused staging buffer and ships each through the client."""

    init_info_cls = LocalTrainerInitInfo

    def worker_init_info(self) -> dict[str, Any]:
        assert isinstance(self.init_info, LocalTrainerInitInfo)
        return {"buffer_size_bytes": self.init_info.buffer_size_bytes}

    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        import torch

        assert isinstance(self.init_info, LocalTrainerInitInfo) and self.client is not None
        metas = source.metadata()
        buckets = plan_buckets(metas, self.init_info.buffer_size_bytes)
        staging = torch.empty(max_bucket_nbytes(buckets), dtype=torch.uint8)
        stats.num_tensors = len(metas)
        stats.num_bytes = sum(m.nbytes for m in metas)
        with stats.phase("control"):
            self.client.start_weight_update()
        for bucket, filled in pack_source(source, metas, buckets, lambda _b: staging, stats):
            with stats.phase("pack"):
                data = base64.b64encode(memoryview(filled.numpy())).decode("ascii")  # type: ignore[arg-type]
            payload: dict[str, Any] = {**metas_to_wire(bucket.metas), "data": data}
            with stats.phase("wire"):
                self.client.update_weights(payload)
            stats.num_buckets += 1
        with stats.phase("control"):
            self.client.finish_weight_update(stats.weight_version)
