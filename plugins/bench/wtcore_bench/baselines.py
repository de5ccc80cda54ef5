"""Which baselines a bench run measures, and measuring them: nothing is named here, what is
installed decides."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wtcore.errors import PayloadError, WtcoreError
from wtcore_bench.api import (
    Baseline,
    BaselineContext,
    EngineBench,
    OptionalDependencyError,
    device_kind,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["BASELINE_SETS", "measure_baselines", "select_baselines"]

BASELINE_SETS = ("auto", "peers", "all", "none")


def select_baselines(
    baselines: str, device: str, support: EngineBench
) -> tuple[dict[str, Baseline], dict[str, str]]:
    """The baselines to measure, and those left out with the reason (``{name: why}``).

    ``auto``: the generic baselines and the engine's own; ``peers``: also every installed
    plugin's peers; ``all``: also every installed engine's baselines.
    """
    from wtcore_bench.limits import GENERIC_BASELINES

    if baselines not in BASELINE_SETS:
        raise PayloadError(
            f"baselines: expected one of {', '.join(BASELINE_SETS)}, got {baselines!r}"
        )
    if baselines == "none":
        return {}, {}
    skipped: dict[str, str] = {}
    peers = baselines in ("peers", "all")
    # (declared baselines, take those that are not peers, take its peers)
    found: list[tuple[Mapping[str, Baseline], bool, bool]] = [
        (GENERIC_BASELINES, True, False),
        (support.baselines, True, peers),
    ]
    if peers:
        found += [(b, baselines == "all", True) for b in _installed_baselines(skipped)]
    out: dict[str, Baseline] = {}
    for declared, with_others, with_peers in found:
        for name, b in declared.items():
            if name in out or not (with_peers if b.peer else with_others):
                continue
            if device_kind(device) not in b.devices:
                skipped[name] = f"runs on {', '.join(b.devices)} only, not --device {device}"
            else:
                out[name] = b
    return out, skipped


def _installed_baselines(skipped: dict[str, str]) -> list[Mapping[str, Baseline]]:
    """What every installed engine and client declares; one that fails to load is skipped."""
    from wtcore.registry import CLIENTS, TRAINER_ENGINES
    from wtcore_bench.support import find_client_bench, find_engine_bench

    out: list[Mapping[str, Baseline]] = []
    for kind, registry, find in (
        ("engine", TRAINER_ENGINES, find_engine_bench),
        ("client", CLIENTS, find_client_bench),
    ):
        for name in registry.names():
            try:
                found = find(name, registry.load(name))
            except (WtcoreError, ImportError) as e:
                skipped[f"{kind}:{name}"] = str(e)
                continue
            if found is not None:
                out.append(found.baselines)
    return out


def measure_baselines(
    baselines: dict[str, Baseline], ctx: BaselineContext, skipped: dict[str, str]
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, b in baselines.items():
        try:
            out[name] = b.measure(ctx)
        except OptionalDependencyError as e:
            skipped[name] = str(e)
    return out
