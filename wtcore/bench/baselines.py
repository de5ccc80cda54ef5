"""Which limits, naive baselines and peers a bench run measures, and measuring them.

``--baselines`` picks a set (:data:`BASELINE_SETS`); the baselines come from the generic limits
(:mod:`wtcore.bench.limits`), the engine's :class:`~wtcore.bench.api.EngineBench`, and, for
``peers`` and ``all``, every installed engine and client (a client class's ``bench_baselines``
import target). Nothing is named here: what is installed decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtcore.bench.api import Baseline, BaselineContext, OptionalDependencyError, device_kind
from wtcore.errors import PayloadError, WtcoreError

if TYPE_CHECKING:
    from wtcore.bench.runner import BenchOptions

__all__ = ["BASELINE_SETS", "measure_baselines", "select_baselines"]

#: ``--baselines`` values.
BASELINE_SETS = ("auto", "peers", "all", "none")


def select_baselines(
    opts: BenchOptions, engine: type[Any]
) -> tuple[dict[str, Baseline], dict[str, str]]:
    """The baselines to measure, and those left out with the reason (``{name: why}``).

    ``auto``: the generic limits and the engine's own limits. ``peers``: those plus every peer
    declared by any installed engine or client. ``all``: every installed engine's limits and
    every peer. A plugin that cannot load, or a baseline that cannot run on ``--device``, is
    left out with its reason rather than failing the run.
    """
    from wtcore.bench.limits import GENERIC_BASELINES

    if opts.baselines not in BASELINE_SETS:
        raise PayloadError(
            f"baselines: expected one of {', '.join(BASELINE_SETS)}, got {opts.baselines!r}"
        )
    if opts.baselines == "none":
        return {}, {}
    skipped: dict[str, str] = {}
    peers = opts.baselines in ("peers", "all")
    # (declared baselines, take its limits, take its peers)
    found: list[tuple[dict[str, Baseline], bool, bool]] = [(dict(GENERIC_BASELINES), True, False)]
    if engine.bench is not None:
        found.append((dict(engine.bench.baselines), True, peers))
    if peers:
        everything = opts.baselines == "all"
        found += [(b, everything, True) for b in _installed_baselines(skipped)]
    out: dict[str, Baseline] = {}
    for declared, limits, with_peers in found:
        for name, b in declared.items():
            if name in out or not (with_peers if b.peer else limits):
                continue
            if device_kind(opts.device) not in b.devices:
                skipped[name] = f"runs on {', '.join(b.devices)} only, not --device {opts.device}"
            else:
                out[name] = b
    return out, skipped


def _installed_baselines(skipped: dict[str, str]) -> list[dict[str, Baseline]]:
    """What every installed engine (``bench.baselines``) and client (``bench_baselines``) declares.

    A plugin that fails to load lands in ``skipped`` under ``engine:<name>`` / ``client:<name>``.
    """
    import pkgutil

    from wtcore.registry import CLIENTS, TRAINER_ENGINES

    out: list[dict[str, Baseline]] = []
    for name in TRAINER_ENGINES.names():
        try:
            cls = TRAINER_ENGINES.load(name)
        except WtcoreError as e:
            skipped[f"engine:{name}"] = str(e)
            continue
        if cls.bench is not None:
            out.append(dict(cls.bench.baselines))
    for name in CLIENTS.names():
        try:
            target = getattr(CLIENTS.load(name), "bench_baselines", None)
            if isinstance(target, str):
                out.append(dict(pkgutil.resolve_name(target)))
        except (WtcoreError, ImportError) as e:
            skipped[f"client:{name}"] = str(e)
    return out


def measure_baselines(
    baselines: dict[str, Baseline], ctx: BaselineContext, skipped: dict[str, str]
) -> dict[str, float]:
    """GB/s of each baseline; one whose package is missing joins ``skipped`` instead."""
    out: dict[str, float] = {}
    for name, b in baselines.items():
        try:
            out[name] = b.measure(ctx)
        except OptionalDependencyError as e:
            skipped[name] = str(e)
    return out
