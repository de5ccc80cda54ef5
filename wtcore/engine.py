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
    """Which worker engine to build, by registry name, plus worker-local options (settings
    both ends must agree on come from the trainer at init instead)."""

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
    """Receives weights for one inference worker and loads them into its sink. Subclasses set
    ``init_info_cls`` and ``update_info_cls`` (dataclasses, parsed with field-named errors)."""

    init_info_cls: ClassVar[type]
    update_info_cls: ClassVar[type]
    #: How this receiver is sharded (``None``: whole replicas), set by the worker so a plan for
    #: another layout can be refused.
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

    def receives_after_return(self, update_info: UpdateT) -> bool:
        """Whether the sender keeps this update's bytes until this worker has them (a stream,
        a collective, a ring that waits for acknowledgements), so a worker may return from
        ``update_weights`` first and receive on a thread: vLLM's adapter does, in staged
        rounds, so generation goes on. ``False``: the sender writes its memory again once the
        call returned (shared weights, a remote read)."""
        return False

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
        self.receive_weights(self.parse_update_info(update_info))

    @abstractmethod
    def receive_weights(self, update_info: UpdateT) -> None:
        """Receive the tensors described by ``update_info`` and load them into the sink."""

    def finish_weight_update(self) -> None:
        """Called once at the end of a successful round."""

    def abort(self) -> None:
        """Give up the current round: make a blocked call return early (it should raise). Called
        from another thread while a call may be blocked, so quick and thread-safe."""

    def shutdown(self) -> None:
        """Release the data plane. Idempotent."""
