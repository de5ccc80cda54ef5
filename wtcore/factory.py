"""Build engines by name, through the registries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wtcore.engine import WeightTransferConfig, WeightTransferEngine
from wtcore.registry import ENGINES, TRAINER_ENGINES
from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

if TYPE_CHECKING:
    from wtcore.client import WeightSyncClient
    from wtcore.sink import WeightSink
    from wtcore.source import WeightSource

__all__ = ["WeightTransferEngineFactory", "WeightTransferTrainerFactory"]


class WeightTransferEngineFactory:
    """Creates worker engines from a :class:`WeightTransferConfig` or a backend name."""

    @staticmethod
    def create_engine(
        config: WeightTransferConfig | str | Mapping[str, Any],
        *,
        sink: WeightSink,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
    ) -> WeightTransferEngine[Any, Any]:
        cfg = WeightTransferConfig.coerce(config)
        cls = ENGINES.load(cfg.backend)
        return cls(cfg, sink=sink, device=device, rank=rank, world_size=world_size)  # type: ignore[no-any-return]


class WeightTransferTrainerFactory:
    """Dispatches ``trainer_init`` on ``init_info.backend``."""

    @staticmethod
    def trainer_init(
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine:
        cls = TRAINER_ENGINES.load(init_info.backend)
        return cls.trainer_init(init_info, client=client, source=source)  # type: ignore[no-any-return]
