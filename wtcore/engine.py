"""The worker (inference) half of a weight-transfer engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from wtcore.errors import PayloadError
from wtcore.parse import parse_dataclass
from wtcore.sink import WeightSink

if TYPE_CHECKING:
    from wtcore.sharded.receiver_layout import TPLayout

__all__ = ["WeightTransferConfig", "WeightTransferEngine"]

InitT = TypeVar("InitT")
UpdateT = TypeVar("UpdateT")


@dataclass(frozen=True)
class WeightTransferConfig:
    """Which worker engine to build, by registry name, plus worker-local options.

    Settings both ends must agree on are *not* here: they come from the trainer in the init
    handshake (docs/protocol.md).
    """

    backend: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def coerce(cls, config: WeightTransferConfig | str | Mapping[str, Any]) -> WeightTransferConfig:
        """Accept a config, a bare backend name, or ``{"backend": ..., **options}``."""
        if isinstance(config, WeightTransferConfig):
            return config
        if isinstance(config, str):
            return cls(config)
        if isinstance(config, Mapping):
            data = dict(config)
            backend = data.pop("backend", None)
            if not isinstance(backend, str) or not backend:
                raise PayloadError(f"config.backend: expected a backend name, got {backend!r}")
            return cls(backend, data)
        raise PayloadError(f"expected a WeightTransferConfig, name or mapping, got {config!r}")


class WeightTransferEngine(ABC, Generic[InitT, UpdateT]):
    """Receives weights for one inference worker and loads them into its sink.

    Subclasses set ``init_info_cls`` and ``update_info_cls`` (dataclasses) and implement
    :meth:`init_transfer_engine` and :meth:`receive_weights`. Parsing is shared: a missing,
    unknown or wrong-typed field raises :class:`~wtcore.errors.PayloadError` (a ``ValueError``)
    naming the field, before anything is received or applied.
    """

    init_info_cls: ClassVar[type]
    update_info_cls: ClassVar[type]
    #: How this receiver is sharded (what its sink reports; ``None``: whole replicas). The
    #: worker sets it, so an engine that executes plans can refuse a round planned for
    #: another layout (:mod:`wtcore.sharded.receiver_layout`).
    receiver_layout: TPLayout | None = None

    def __init__(
        self,
        config: WeightTransferConfig,
        *,
        sink: WeightSink,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise PayloadError(f"rank must be in [0, {world_size}), got {rank}")
        self.config = config
        self.sink = sink
        self.device = device
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def host_status(cls) -> str:
        """One line saying whether and how this engine can run here (``wtcore plugins``)."""
        return "available"

    def parse_init_info(self, data: Mapping[str, Any]) -> InitT:
        return parse_dataclass(self.init_info_cls, data, what="init_info")  # type: ignore[no-any-return]

    def parse_update_info(self, data: Mapping[str, Any]) -> UpdateT:
        return parse_dataclass(self.update_info_cls, data, what="update_info")  # type: ignore[no-any-return]

    @abstractmethod
    def init_transfer_engine(self, init_info: InitT) -> None:
        """Join the data plane (may block until the trainer joins too)."""

    def start_weight_update(self) -> None:
        """Called once at the start of each round."""

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """Parse, receive and load one update."""
        self.receive_weights(self.parse_update_info(update_info))

    @abstractmethod
    def receive_weights(self, update_info: UpdateT) -> None:
        """Receive the tensors described by ``update_info`` and load them into the sink."""

    def finish_weight_update(self) -> None:
        """Called once at the end of a successful round."""

    def abort(self) -> None:
        """Give up the current round: make a blocked call return early, drop its leftovers.

        Called by the receiver when a round is abandoned (a new init, an abort, the round
        deadline), possibly from another thread while :meth:`receive_weights` or
        :meth:`init_transfer_engine` is blocked, so it must be quick and thread-safe. The
        call it interrupts should raise; the receiver ignores what it does afterwards. The
        engine stays usable: the next init re-initializes it. The default does nothing.
        """

    def shutdown(self) -> None:
        """Release the data plane. Idempotent."""
