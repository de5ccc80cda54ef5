"""The bucket engines' kit: everything but the moving of bytes, so a new engine is its transport.

One announcement per bucket; docs/writing-an-engine.md builds an engine on it. Engines that
announce a round once and stream its bytes (nccl, tcp) use ``wtcore_channel`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from wtcore.buckets import max_bucket_nbytes, pack_source, plan_round
from wtcore.defaults import DEFAULT_TIMEOUT_S, check_timeout
from wtcore.engine import WeightTransferEngine
from wtcore.errors import PayloadError, ProtocolStateError, TransferTimeoutError
from wtcore.meta import ParamMeta, metas_from_wire, metas_to_wire
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine
from wtcore_kit.concurrency import BackgroundCall

if TYPE_CHECKING:
    import torch

    from wtcore.buckets import Bucket
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats

__all__ = [
    "SETTLE_GRACE_S",
    "BucketUpdateInfo",
    "BucketedTrainerEngine",
    "BucketedTrainerInitInfo",
    "BucketedWorkerEngine",
    "check_bucket_options",
]

InitT = TypeVar("InitT")
#: Seconds beyond ``timeout_s`` the trainer waits for an update, so the client's own timeout
#: (which names the receiver) ends the call first.
SETTLE_GRACE_S = 2.0
UpdateT = TypeVar("UpdateT")


def check_bucket_options(
    *, packed_buffer_size_bytes: object, packed_num_buffers: object, timeout_s: object = 1.0
) -> None:
    """Validate the shared options; a ``ValueError`` names the field (both ends use this)."""
    for name, value in (
        ("packed_buffer_size_bytes", packed_buffer_size_bytes),
        ("packed_num_buffers", packed_num_buffers),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PayloadError(f"{name}: expected a positive integer, got {value!r}")
    check_timeout("timeout_s", timeout_s)


@dataclass
class BucketedTrainerInitInfo(TrainerInitInfo, abstract=True):
    """The options every bucket engine has, with vLLM's names (keyword-only; redeclare a field
    to change its default). ``packed_num_buffers`` staging buffers let the next bucket be
    packed while one is on the wire; ``timeout_s`` bounds every blocking wait."""

    packed: bool = field(default=True, kw_only=True)
    packed_buffer_size_bytes: int = field(default=1 << 30, kw_only=True)
    packed_num_buffers: int = field(default=2, kw_only=True)
    timeout_s: float = field(default=DEFAULT_TIMEOUT_S, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.packed, bool):
            raise PayloadError(f"packed: expected a bool, got {self.packed!r}")
        check_bucket_options(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            timeout_s=self.timeout_s,
        )

    def plan(self, metas: Sequence[ParamMeta]) -> list[Bucket]:
        """This round's buckets (the receivers compute the same from the metadata)."""
        return plan_round(
            metas, packed=self.packed, buffer_size_bytes=self.packed_buffer_size_bytes
        )


@dataclass
class BucketUpdateInfo:
    """The metadata of one update (vLLM's names), checked into ``metas`` on arrival; engines
    subclass it to add where the bytes are."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    metas: list[ParamMeta] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.metas = metas_from_wire(self.names, self.dtype_names, self.shapes)

    @staticmethod
    def wire(metas: Sequence[ParamMeta]) -> dict[str, Any]:
        """The JSON fields for ``metas``."""
        return metas_to_wire(metas)


class BucketedTrainerEngine(TrainerWeightTransferEngine):
    """Trainer half of a bucket engine: implement :meth:`worker_init_info` and
    :meth:`send_bucket`; the other hooks are optional."""

    init_info_cls: ClassVar[type[TrainerInitInfo]] = BucketedTrainerInitInfo

    def __init__(self, init_info: TrainerInitInfo, **kwargs: Any) -> None:
        super().__init__(init_info, **kwargs)  # refuses any but an init_info_cls
        assert isinstance(init_info, BucketedTrainerInitInfo)
        self.info: BucketedTrainerInitInfo = init_info
        self._slots: list[torch.Tensor] = []
        self._capacity = -1
        self._inflight: BackgroundCall[Any] | None = None
        self._planned: tuple[list[ParamMeta], list[Bucket]] = ([], [])  # by _prepare, for _send

    def send_bucket(self, bucket: Bucket, filled: torch.Tensor, slot: int) -> dict[str, Any] | None:
        """Move one bucket (``filled``, in staging slot ``slot``, written again only once the
        call returned); return its announcement (or ``None``), sent while the next is packed."""
        raise NotImplementedError

    def allocate_staging(self, capacity: int, count: int) -> list[torch.Tensor]:
        """``count`` flat ``uint8`` buffers of ``capacity`` bytes; override for special memory."""
        import torch

        return [torch.empty(capacity, dtype=torch.uint8) for _ in range(count)]

    def release_staging(self) -> None:
        """Free the staging buffers (after a failure, at shutdown, before growing them)."""
        self._slots, self._capacity = [], -1

    def fill(
        self,
        source: WeightSource,
        metas: list[ParamMeta],
        buckets: list[Bucket],
        slots: list[torch.Tensor],
        stats: TransferStats,
    ) -> Iterator[tuple[Bucket, Any]]:
        """Each bucket of the round in order, as :meth:`send_bucket` gets it (by default packed
        into ``slots``); by the bucket after next, this one's call has returned."""
        nbuf = len(slots)
        return pack_source(source, metas, buckets, lambda b: slots[b.index % nbuf], stats)

    def abandon_round(self) -> None:
        """First thing after a failure, before the call in flight is waited for: tell
        receivers waiting for bytes that will never come to give up."""

    def round_failed(self) -> None:
        """After a failure, before its error propagates: free the staging (and end any transfer
        that could outlive the round)."""
        self.release_staging()

    def begin_round(self, metas: list[ParamMeta], buckets: list[Bucket]) -> None:
        """Once the round is open, before the first bucket."""

    def end_round(self, stats: TransferStats) -> None:
        """After the last announcement returned, before the finish."""

    def staging(self, capacity: int) -> list[torch.Tensor]:
        """The reused staging slots, grown (never shrunk) to ``capacity`` bytes."""
        if capacity > self._capacity:
            self.release_staging()
            self._slots = self.allocate_staging(capacity, self.info.packed_num_buffers)
            self._capacity = capacity
        return self._slots

    def _settle(self, stats: TransferStats) -> None:
        call, self._inflight = self._inflight, None
        if call is not None:
            with stats.phase("wire"):
                call.result(self.info.timeout_s + SETTLE_GRACE_S)

    def _prepare(self, source: WeightSource, stats: TransferStats) -> None:
        """Plan and size the staging before the round opens (an engine that announced its
        slots may re-run the handshake when they grow)."""
        metas = source.metadata()
        self._planned = metas, self.info.plan(metas)
        if self._planned[1]:
            self.staging(max_bucket_nbytes(self._planned[1]))

    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        assert self.client is not None, "the sender always has a client"
        metas, buckets = self._planned
        stats.num_tensors = len(metas)
        stats.num_bytes = sum(m.nbytes for m in metas)
        slots = self._slots if buckets else []
        nbuf = len(slots)
        try:
            self.begin_round(metas, buckets)
            for bucket, filled in self.fill(source, metas, buckets, slots, stats):
                payload = self.send_bucket(bucket, filled, bucket.index % nbuf)
                stats.num_buckets += 1
                if payload is None:
                    continue
                self._settle(stats)  # one call in flight; its slot is free once it returned
                self._inflight = BackgroundCall(
                    self.client.update_weights, payload, name="update_weights"
                )
                if nbuf == 1:
                    self._settle(stats)  # the next bucket reuses this very slot
            self._settle(stats)
            self.end_round(stats)
        except BaseException as e:
            # Let a call still reading our buffer end (bounded), then free the staging.
            self.abandon_round()
            call, self._inflight = self._inflight, None
            if call is not None and not isinstance(e, TransferTimeoutError):
                call.wait(self.info.timeout_s)
            self.round_failed()
            raise

    def shutdown(self) -> None:
        self.release_staging()
        super().shutdown()


class BucketedWorkerEngine(WeightTransferEngine[InitT, UpdateT], Generic[InitT, UpdateT]):
    """Worker half of a bucket engine: keeps the init info (:attr:`settings`)."""

    _init: InitT | None = None

    def init_transfer_engine(self, init_info: InitT) -> None:
        self._init = init_info

    @property
    def settings(self) -> InitT:
        """The init info; :class:`ProtocolStateError` (HTTP 409) before init."""
        if self._init is None:
            raise ProtocolStateError(
                f"{self.config.backend} engine: init_transfer_engine was not called"
            )
        return self._init

    def shutdown(self) -> None:
        self._init = None
