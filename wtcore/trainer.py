"""The trainer half of a weight-transfer engine."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from wtcore.errors import PayloadError, ProtocolStateError, WrongTypeError
from wtcore.source import WeightSource, iter_checked
from wtcore.stats import TransferStats

if TYPE_CHECKING:
    from wtcore.client import WeightSyncClient

__all__ = ["TrainerInitInfo", "TrainerWeightTransferEngine"]

E = TypeVar("E", bound="TrainerWeightTransferEngine")


@dataclass
class TrainerInitInfo:
    """Trainer-side settings of one engine; subclasses set ``backend`` to the registry name.

    Settings both ends must agree on live only here, and the trainer engine ships them to the
    workers in the init handshake, so a mismatch cannot be expressed.
    """

    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.__dict__.get("backend", getattr(cls, "backend", None)), str):
            raise WrongTypeError(
                f"{cls.__name__} must set the class attribute `backend` to the name of its "
                "engine in the wtcore.trainer_engines registry"
            )

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise PayloadError(f"rank: expected a non-negative int, got {self.rank!r}")

    @property
    def is_sender(self) -> bool:
        """Trainer rank 0 sends; other ranks only iterate the source in lockstep."""
        return self.rank == 0


class TrainerWeightTransferEngine(ABC):
    """Sends a :class:`WeightSource` to every receiver reachable through a client.

    :meth:`send_weights` is a template: it handles non-sender ranks (iterate in lockstep,
    touch nothing else), the hooks (started / finished / failed) and the stats, and calls the
    engine's :meth:`_send` only on the sender.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None,
    ) -> None:
        if init_info.is_sender and client is None:
            raise PayloadError("trainer_init: the sender (rank 0) needs a client")
        self.init_info = init_info
        self.client = client
        self.source = source
        self._closed = False

    @classmethod
    def host_status(cls) -> str:
        """One line saying whether and how this engine can run here (``wtcore plugins``)."""
        return "available"

    @classmethod
    @abstractmethod
    def trainer_init(
        cls: type[E],
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None = None,
    ) -> E:
        """Rendezvous with the workers and initialize them; called on every trainer rank."""

    def send_weights(
        self,
        source: WeightSource | None = None,
        *,
        weight_version: str | None = None,
        verify: bool = False,
    ) -> TransferStats:
        """Run one round (start, updates, finish); returns when every receiver has loaded.

        With ``verify=True`` every receiver's checksums are compared with digests of what was
        sent before the round is finished (see :mod:`wtcore.verify`); the client must be a
        :class:`~wtcore.client.InspectableClient`.
        """
        from wtcore.hooks import notify

        if self._closed:
            raise ProtocolStateError(f"{type(self).__name__} was shut down")
        src = source if source is not None else self.source
        if src is None:
            raise PayloadError("send_weights: no source given here or at trainer_init")
        stats = TransferStats(weight_version=weight_version, backend=self.init_info.backend)
        t0 = time.perf_counter()
        if not self.init_info.is_sender:
            with stats.phase("materialize"):
                for meta, _ in iter_checked(src):
                    stats.num_tensors += 1
                    stats.num_bytes += meta.nbytes
            stats.seconds = time.perf_counter() - t0
            return stats
        notify("wtcore_update_started", engine=self, weight_version=weight_version)
        client = self.client
        try:
            if verify:
                from wtcore.verify import DigestingSource, VerifyingClient

                assert client is not None, "the sender always has a client"
                src = DigestingSource(src)
                self.client = VerifyingClient(client, src)
            self._send(src, stats)
        except BaseException as e:
            notify("wtcore_update_failed", engine=self, weight_version=weight_version, error=e)
            raise
        finally:
            self.client = client
        stats.seconds = time.perf_counter() - t0
        notify("wtcore_update_finished", engine=self, stats=stats)
        return stats

    @abstractmethod
    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        """Sender only: start, update(s), finish through ``self.client``; fill ``stats``."""

    def shutdown(self) -> None:
        """Release the data plane. Idempotent."""
        self._closed = True

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
