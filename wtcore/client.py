"""The control-plane protocol every client (HTTP, Ray, in-process) implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["WeightSyncClient"]


@runtime_checkable
class WeightSyncClient(Protocol):
    """Blocking calls that reach every receiver and raise on any failure (DESIGN §2, §4).

    ``update_info`` is one dict for all receivers, or a list with one entry per worker rank.
    A :class:`~wtcore.worker.WeightSyncWorker` satisfies this protocol itself.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...
