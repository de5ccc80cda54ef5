"""``inline``: the reference engine pair, and the template for plugin authors.

The data travels *inline*, inside the control-plane payload, base64-encoded, one bucket per
``update_weights`` call. That makes it the simplest engine that runs the whole protocol over
any client (in-process, HTTP, Ray) with no data plane to set up. It is meant for tests, demos
and tiny models: every byte is copied through JSON, so it is slow by design. Named ``local``
before 0.2.0 (that name and ``wtcore.local`` still work, with a warning, until 0.3).

Built on :mod:`wtcore.bucketed`, so this module is only the transport: encode a packed bucket,
decode it. The worker re-plans each update's metadata with the shared rule and refuses
anything but exactly one bucket of the advertised size, so a payload cannot make it allocate
more than the trainer announced at init.
"""

from __future__ import annotations

import base64
import binascii
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore.bucketed import (
    BucketedTrainerEngine,
    BucketedTrainerInitInfo,
    BucketedWorkerEngine,
    BucketUpdateInfo,
    check_bucket_options,
)
from wtcore.buckets import plan_round, unpack_bucket
from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket

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
    """Trainer settings of the ``inline`` engine (see
    :class:`~wtcore.bucketed.BucketedTrainerInitInfo`).

    ``buffer_size_bytes`` is the deprecated name of ``packed_buffer_size_bytes`` (accepted,
    with a ``DeprecationWarning``, until the next release).
    """

    backend: ClassVar[str] = "inline"
    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)
    buffer_size_bytes: int | None = field(default=None, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        if self.buffer_size_bytes is not None:
            warnings.warn(
                "InlineTrainerInitInfo.buffer_size_bytes is deprecated and will be removed in "
                "the next release; use packed_buffer_size_bytes",
                DeprecationWarning,
                stacklevel=3,
            )
            self.packed_buffer_size_bytes, self.buffer_size_bytes = self.buffer_size_bytes, None
        super().__post_init__()


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


class InlineWorkerEngine(BucketedWorkerEngine[InlineInitInfo, InlineUpdateInfo]):
    """Decodes each bucket from the payload and loads it into the sink."""

    init_info_cls = InlineInitInfo
    update_info_cls = InlineUpdateInfo
    renamed_init_fields: ClassVar[dict[str, str]] = {
        "buffer_size_bytes": "packed_buffer_size_bytes"
    }

    def receive_weights(self, update_info: InlineUpdateInfo) -> None:
        import torch

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


class InlineTrainerEngine(BucketedTrainerEngine):
    """Encodes each packed bucket into its ``update_weights`` payload."""

    init_info_cls = InlineTrainerInitInfo

    def worker_init_info(self) -> dict[str, Any]:
        return {
            "packed_buffer_size_bytes": self.info.packed_buffer_size_bytes,
            "packed": self.info.packed,
        }

    def send_bucket(self, bucket: Bucket, filled: torch.Tensor, slot: int) -> dict[str, Any]:
        # The payload is a copy, so the slot is free again as soon as this returns.
        data = base64.b64encode(memoryview(filled.numpy())).decode("ascii")  # type: ignore[arg-type]
        return {**BucketUpdateInfo.wire(bucket.metas), "data": data}
