"""The receiver end: a plain class that serves one :class:`wtcore.WeightSyncWorker`.

It neither imports Ray nor is decorated, so it can become an actor or be mixed into an
inference actor (:meth:`~WeightSyncActor.setup_weight_sync` once the model exists). The sink is
built inside the actor because a model must never travel through the control plane. Run it
threaded (``max_concurrency`` >= 2) so ``weight_info`` tells "busy" from "stuck".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Union

from wtcore.engine import WeightTransferConfig
from wtcore.errors import PayloadError, ProtocolStateError
from wtcore.sink import WeightSink
from wtcore.worker import WeightSyncWorker

__all__ = ["SinkFactory", "WeightSyncActor"]

#: A sink, or a zero-argument callable that builds one (called inside the actor).
SinkFactory = Union[WeightSink, Callable[[], WeightSink]]


def _build_sink(sink: SinkFactory) -> WeightSink:
    if isinstance(sink, WeightSink):
        return sink
    if not callable(sink):
        raise PayloadError(
            f"sink: expected a WeightSink or a zero-argument callable returning one, got {sink!r}"
        )
    built = sink()
    if not isinstance(built, WeightSink):
        raise PayloadError(
            f"sink factory {getattr(sink, '__name__', sink)!r} returned "
            f"{type(built).__name__}, which has no load_weights(weights)"
        )
    return built


class WeightSyncActor:
    """One inference worker's control-plane endpoint, meant to run as (or in) a Ray actor."""

    def __init__(
        self,
        config: WeightTransferConfig | str | Mapping[str, Any],
        sink: SinkFactory,
        **options: Any,
    ) -> None:
        self.setup_weight_sync(config, sink, **options)

    def setup_weight_sync(
        self,
        config: WeightTransferConfig | str | Mapping[str, Any],
        sink: SinkFactory,
        *,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
        label: str | None = None,
        **worker_options: Any,
    ) -> None:
        """Build the sink and the core worker (``worker_options`` go to it); for mixins, call
        it once the model exists."""
        if getattr(self, "_wtcore_worker", None) is not None:
            raise ProtocolStateError("setup_weight_sync: already set up on this actor")
        self._wtcore_label = label
        self._wtcore_worker: WeightSyncWorker | None = WeightSyncWorker(
            config,
            _build_sink(sink),
            device=device,
            rank=rank,
            world_size=world_size,
            **worker_options,
        )

    @property
    def weight_sync_worker(self) -> WeightSyncWorker:
        worker: WeightSyncWorker | None = getattr(self, "_wtcore_worker", None)
        if worker is None:
            raise ProtocolStateError(
                f"{type(self).__name__}: call setup_weight_sync(config, sink, ...) first"
            )
        return worker

    def init_weight_transfer_engine(
        self, init_info: dict[str, Any], *, round_id: str | None = None
    ) -> None:
        self.weight_sync_worker.init_weight_transfer_engine(init_info, round_id=round_id)

    def weight_checker(
        self, action: str, baseline: Any = None, *, round_id: str | None = None
    ) -> dict[str, Any]:
        return self.weight_sync_worker.weight_checker(action, baseline, round_id=round_id)

    def update_weight_version(self, new_version: str, *, round_id: str | None = None) -> None:
        self.weight_sync_worker.update_weight_version(new_version, round_id=round_id)

    def start_weight_update(self, *, round_id: str | None = None) -> None:
        self.weight_sync_worker.start_weight_update(round_id=round_id)

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]], *, round_id: str | None = None
    ) -> None:
        self.weight_sync_worker.update_weights(update_info, round_id=round_id)

    def finish_weight_update(
        self, weight_version: str | None = None, *, round_id: str | None = None
    ) -> None:
        self.weight_sync_worker.finish_weight_update(weight_version, round_id=round_id)

    def abort_weight_update(
        self, reason: str = "aborted by caller", *, round_id: str | None = None
    ) -> None:
        self.weight_sync_worker.abort_weight_update(reason, round_id=round_id)

    def weight_info(self) -> dict[str, Any]:
        return self.weight_sync_worker.weight_info()

    def checksums(self) -> dict[str, str]:
        return self.weight_sync_worker.checksums()

    def get_world_size(self) -> int:
        return self.weight_sync_worker.world_size

    def identity(self) -> dict[str, Any]:
        worker = self.weight_sync_worker
        ident: dict[str, Any] = {
            "label": self._wtcore_label,
            "rank": worker.rank,
            "world_size": worker.world_size,
            "backend": worker.config.backend,
            "pid": os.getpid(),
            "actor_id": None,
            "name": None,
            "node_ip": None,
        }
        try:
            import ray

            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                ident["actor_id"] = ctx.get_actor_id()
                ident["name"] = ctx.get_actor_name() or None
                ident["node_ip"] = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        except ImportError:  # used as a plain object, without Ray
            pass
        return ident

    def shutdown_weight_sync(self) -> None:
        """Release the data plane (idempotent); the actor process stays alive."""
        worker = getattr(self, "_wtcore_worker", None)
        if worker is not None:
            worker.shutdown()
