"""A client that records every call, for tests that pin payloads or call order."""

from __future__ import annotations

import json
import threading
from typing import Any

from wtcore.client import WeightSyncClient
from wtcore.errors import PayloadError

__all__ = ["RecordingClient"]


class RecordingClient:
    """Records ``(call, payload)`` pairs and forwards them to ``inner`` if given; every
    payload must survive a JSON round trip unchanged (the control plane is never pickle)."""

    def __init__(self, inner: WeightSyncClient | None = None) -> None:
        self.inner = inner
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def _record(self, call: str, payload: Any, *args: Any) -> None:
        try:
            same = json.loads(json.dumps(payload)) == payload
        except (TypeError, ValueError) as e:
            raise PayloadError(f"{call}: payload is not JSON-serializable: {e}") from e
        if not same:
            raise PayloadError(f"{call}: payload changes in a JSON round trip: {payload!r}")
        with self._lock:
            self.calls.append((call, payload))
        if self.inner is not None:
            getattr(self.inner, call)(*args)

    def names(self) -> list[str]:
        return [c for c, _ in self.calls]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._record("init_weight_transfer_engine", init_info, init_info)

    def start_weight_update(self) -> None:
        self._record("start_weight_update", None)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._record("update_weights", update_info, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._record("finish_weight_update", weight_version, weight_version)
