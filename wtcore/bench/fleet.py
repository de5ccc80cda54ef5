"""Receivers that the bench starts and always stops.

A :class:`ReceiverFleet` is a client plus the processes behind it. The bench asks the client
plugins for one through the ``wtcore_launch_receivers`` hook (first answer wins), so the core
never imports a plugin; ``inproc`` is built here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from wtcore.worker import WeightSyncWorker

__all__ = ["InProcessFleet", "ModelSpec", "ReceiverFleet", "launch_fleet"]


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic model, rebuilt identically (names, shapes, dtypes) on every receiver."""

    size_bytes: int
    num_tensors: int
    dtype: str
    seed: int = 0

    def build_state(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        from wtcore.testing.sources import synthetic_state

        return synthetic_state(
            self.size_bytes, self.num_tensors, self.dtype, self.seed if seed is None else seed
        )

    def build_zeros(self) -> torch.nn.Module:
        """A receiver model: the right names, shapes and dtypes, all zeros."""
        from wtcore.testing.sources import build_module, zeros_like_state

        return build_module(zeros_like_state(self.build_state()))


class ReceiverFleet(Protocol):
    """A started set of receivers: a fan-out client (with ``checksums()``) and their PIDs."""

    client: Any

    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


class InProcessFleet:
    """Receivers in this process, driven through :class:`~wtcore.inproc.InProcessClient`."""

    def __init__(
        self, backend: str, count: int, model: ModelSpec, *, timeout_s: float, **worker_kw: Any
    ) -> None:
        from wtcore.inproc import InProcessClient
        from wtcore.sink import ModuleSink
        from wtcore.worker import WeightSyncWorker

        self.workers: list[WeightSyncWorker] = [
            WeightSyncWorker(
                backend, ModuleSink(model.build_zeros()), rank=i, world_size=count, **worker_kw
            )
            for i in range(count)
        ]
        self.client = InProcessClient(self.workers, timeout_s=timeout_s)

    def pids(self) -> list[int]:
        return [os.getpid()]

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def launch_fleet(
    client: str, backend: str, count: int, model: ModelSpec, *, timeout_s: float, **worker_kw: Any
) -> ReceiverFleet:
    """Start ``count`` receivers for ``client``; raises if no plugin can launch them."""
    if client == "inproc":
        return InProcessFleet(backend, count, model, timeout_s=timeout_s, **worker_kw)
    from wtcore.hooks import get_plugin_manager
    from wtcore.registry import CLIENTS

    CLIENTS.info(client)  # unknown name -> the registry's "did you mean" error
    fleet: ReceiverFleet | None = get_plugin_manager().hook.wtcore_launch_receivers(
        client=client,
        backend=backend,
        count=count,
        model=model,
        timeout_s=timeout_s,
        options=dict(worker_kw),
    )
    if fleet is None:
        raise RuntimeError(
            f"client {client!r} cannot start receivers for the bench: its plugin does not "
            "implement the wtcore_launch_receivers hook"
        )
    return fleet
