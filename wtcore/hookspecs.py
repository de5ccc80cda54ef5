"""The hooks (pluggy project ``wtcore``, group ``wtcore.hooks``): observers of each round,
and CLI commands. Selecting an engine is never a hook: that is the registries' job."""

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


@hookspec
def wtcore_add_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``wtcore`` subcommands; set ``func`` (``args -> int``) with ``set_defaults``."""
