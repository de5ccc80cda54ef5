"""Receivers that the bench starts and always stops.

The bench gets receivers from the chosen client class: its ``bench_launcher`` names a
:class:`~wtcore.bench.api.ReceiverLauncher`, imported only now, so the core never imports or
names a plugin. :class:`InProcessFleet` is the built-in client's launcher.
"""

from __future__ import annotations

import os
import pkgutil
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wtcore.bench.api import BenchNotSupportedError, ModelSpec, ReceiverFleet
from wtcore.errors import WrongTypeError

if TYPE_CHECKING:
    from wtcore.worker import WeightSyncWorker

__all__ = ["InProcessFleet", "ModelSpec", "ReceiverFleet", "launch_fleet"]


class InProcessFleet:
    """Receivers in this process, driven by one fan-out client of ``client_cls``."""

    def __init__(
        self,
        client_cls: type[Any],
        backend: str,
        count: int,
        model: ModelSpec,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> None:
        from wtcore.sink import ModuleSink
        from wtcore.worker import WeightSyncWorker

        self.workers: list[WeightSyncWorker] = [
            WeightSyncWorker(
                backend,
                ModuleSink(model.build_zeros()),
                device=model.device,
                rank=i,
                world_size=count,
                **options,
            )
            for i in range(count)
        ]
        self.client = client_cls(self.workers, timeout_s=timeout_s)

    def pids(self) -> list[int]:
        return [os.getpid()]

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def launch_fleet(
    client: str,
    backend: str,
    count: int,
    model: ModelSpec,
    *,
    timeout_s: float,
    options: Mapping[str, Any] | None = None,
) -> ReceiverFleet:
    """Start ``count`` receivers reachable by the client registered as ``client``.

    The fleet's client must be an :class:`~wtcore.client.InspectableClient` (the bench reads
    every receiver's ``checksums()`` and ``weight_info()``); checked here, once, so the runner
    never guesses at return shapes.
    """
    from wtcore.registry import CLIENTS

    cls = CLIENTS.load(client)  # unknown name -> the registry's "did you mean" error
    target = getattr(cls, "bench_launcher", None)
    opts = dict(options or {})
    fleet: ReceiverFleet | None
    if isinstance(target, str):
        launcher = pkgutil.resolve_name(target)
        fleet = launcher(cls, backend, count, model, timeout_s=timeout_s, options=opts)
    else:
        fleet = _legacy_hook(client, backend, count, model, timeout_s, opts)
    if fleet is not None:
        return _inspectable(client, fleet)
    raise BenchNotSupportedError(
        f"client {client!r} ({cls.__module__}.{cls.__qualname__}) cannot start receivers for "
        "wtcore bench: set its `bench_launcher` class attribute to the import target of a "
        "wtcore.bench.ReceiverLauncher (see docs/writing-an-engine.md)"
    )


def _inspectable(client: str, fleet: ReceiverFleet) -> ReceiverFleet:
    """``fleet``, if its client can inspect its receivers; else stop them and say so."""
    from wtcore.client import InspectableClient, calls_of

    if isinstance(fleet.client, InspectableClient):
        return fleet
    fleet.close()
    kind = type(fleet.client)
    missing = [
        n for n in calls_of(InspectableClient) if not callable(getattr(fleet.client, n, None))
    ]
    raise WrongTypeError(
        f"client {client!r}: the bench needs a wtcore.client.InspectableClient, but its launcher "
        f"returned a {kind.__module__}.{kind.__qualname__}, which lacks {', '.join(missing)}"
    )


def _legacy_hook(
    client: str,
    backend: str,
    count: int,
    model: ModelSpec,
    timeout_s: float,
    options: dict[str, Any],
) -> ReceiverFleet | None:
    """The deprecated ``wtcore_launch_receivers`` hook, asked only when the class says nothing."""
    from wtcore.hooks import get_plugin_manager

    caller = get_plugin_manager().hook.wtcore_launch_receivers
    if not caller.get_hookimpls():
        return None
    fleet: ReceiverFleet | None = caller(
        client=client,
        backend=backend,
        count=count,
        model=model,
        timeout_s=timeout_s,
        options=options,
    )
    if fleet is not None:
        warnings.warn(
            f"receivers for client {client!r} came from the wtcore_launch_receivers hook, "
            "which is deprecated and will be removed in the next release: set "
            "`bench_launcher` on the client class instead",
            DeprecationWarning,
            stacklevel=3,
        )
    return fleet
