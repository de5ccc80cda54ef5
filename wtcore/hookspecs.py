"""The 1:N hooks (pluggy project ``wtcore``, entry-point group ``wtcore.hooks``).

Observers of each update, for metrics and logging, and CLI commands contributed by plugins.
Selecting an engine is never a hook: that is the registries' job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from wtcore.stats import TransferStats

hookspec = pluggy.HookspecMarker("wtcore")
hookimpl = pluggy.HookimplMarker("wtcore")


@hookspec
def wtcore_update_started(engine: Any, weight_version: str | None) -> None:
    """A trainer engine's sender starts a round."""


@hookspec
def wtcore_update_finished(engine: Any, stats: TransferStats, weight_version: str | None) -> None:
    """A round finished: every receiver loaded it and published ``weight_version``."""


@hookspec
def wtcore_update_failed(engine: Any, weight_version: str | None, error: BaseException) -> None:
    """A round failed with ``error`` (re-raised to the caller after the hooks ran)."""


@hookspec(firstresult=True)
def wtcore_launch_receivers(
    client: str, backend: str, count: int, model: Any, timeout_s: float, options: dict[str, Any]
) -> Any:
    """Deprecated (removed in 0.3): declare a ``wtcore_bench.ClientBench`` for the client.

    Start ``count`` receivers reachable by client ``client`` for ``wtcore bench``. Asked only
    when the client declares none (``client.<name>`` in the ``wtcore.bench`` entry-point
    group); using it warns.

    Return a :class:`wtcore_bench.ReceiverFleet` (a ``client`` attribute with ``checksums()``,
    ``pids()`` and ``close()``), or ``None`` if ``client`` is not yours. Each receiver hosts
    ``model.build_zeros()`` with worker engine ``backend``, rank ``i`` of ``count``; ``options``
    are extra ``WeightSyncWorker`` keyword arguments (e.g. ``transactional``).
    """


@hookspec
def wtcore_add_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``wtcore`` subcommands; set ``func`` (``args -> int``) with ``set_defaults``."""
