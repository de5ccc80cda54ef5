"""Which engines and clients the bench can drive, found by their registered names.

An engine says how it runs in the bench (an :class:`~wtcore_bench.api.EngineBench`) in the
entry-point group ``wtcore.bench_engines``; a client says how the bench starts receivers it can
reach (a :class:`~wtcore_bench.api.ClientBench`) in ``wtcore.bench_clients``. Both are keyed by
the name the engine or client is registered under in the core. The protocol's classes carry
nothing for the bench, so loading an engine never loads the bench.

Classes written for earlier releases that still set ``bench`` (engine) or ``bench_launcher`` /
``bench_baselines`` (client) class attributes keep working for this release, with a
``DeprecationWarning``. :func:`register_engine_bench` / :func:`register_client_bench` register
support in code (tests, notebooks) without an entry point.
"""

from __future__ import annotations

import pkgutil
import warnings
from typing import Any, TypeVar

from wtcore.registry import TRAINER_ENGINES, autoload_disabled
from wtcore_bench.api import BenchNotSupportedError, ClientBench, EngineBench

__all__ = [
    "CLIENT_GROUP",
    "ENGINE_GROUP",
    "client_bench",
    "engine_bench",
    "find_client_bench",
    "find_engine_bench",
    "register_client_bench",
    "register_engine_bench",
]

T = TypeVar("T")
ENGINE_GROUP = "wtcore.bench_engines"
CLIENT_GROUP = "wtcore.bench_clients"

_explicit: dict[str, dict[str, Any]] = {ENGINE_GROUP: {}, CLIENT_GROUP: {}}


def register_engine_bench(name: str, bench: EngineBench | None) -> None:
    """How engine ``name`` runs in the bench (``None`` forgets an earlier registration)."""
    _register(ENGINE_GROUP, name, bench)


def register_client_bench(name: str, bench: ClientBench | None) -> None:
    """How the bench starts receivers for client ``name`` (``None`` forgets it)."""
    _register(CLIENT_GROUP, name, bench)


def _register(group: str, name: str, value: object | None) -> None:
    if value is None:
        _explicit[group].pop(name, None)
    else:
        _explicit[group][name] = value


def _declared(group: str, name: str) -> Any:
    """What ``name`` declared in ``group``: explicit first, then its entry point; else ``None``."""
    if name in _explicit[group]:
        return _explicit[group][name]
    if autoload_disabled():
        return None
    from importlib.metadata import entry_points

    for ep in entry_points(group=group, name=name):
        try:
            return ep.load()
        except Exception as e:  # a broken plugin is this name's problem, not the run's
            raise BenchNotSupportedError(
                f"{group} entry point {name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}"
            ) from e
    return None


def _legacy(owner: type[Any], attr: str, group: str) -> Any:
    value = getattr(owner, attr, None)
    if value is not None:
        warnings.warn(
            f"{owner.__qualname__}.{attr} is deprecated and will be removed in 0.3: declare the "
            f"bench support in the {group!r} entry-point group (CHANGELOG, 0.2.0, "
            '"For plugin authors")',
            DeprecationWarning,
            stacklevel=3,
        )
    return value


def _checked(found: Any, kind: type[T], where: str) -> T | None:
    """``found`` if it is ``None`` or a ``kind``; else an error naming what was declared."""
    if found is None or isinstance(found, kind):
        return found
    raise BenchNotSupportedError(
        f"{where} names a {type(found).__name__}, not a wtcore_bench.{kind.__name__}"
    )


def find_engine_bench(name: str, cls: type[Any] | None = None) -> EngineBench | None:
    """How engine ``name`` (class ``cls``, if loaded) runs in the bench; ``None``: undeclared."""
    found = _declared(ENGINE_GROUP, name)
    if found is None and name in TRAINER_ENGINES.renamed:  # an old name, with a warning
        found = _declared(ENGINE_GROUP, TRAINER_ENGINES.resolve(name))
    if found is None and cls is not None:
        found = _legacy(cls, "bench", ENGINE_GROUP)
    return _checked(found, EngineBench, f"engine {name!r}: {ENGINE_GROUP}")


def engine_bench(name: str, cls: type[Any] | None = None) -> EngineBench:
    """:func:`find_engine_bench`, or an error that says how to declare it."""
    found = find_engine_bench(name, cls)
    if found is None:
        raise BenchNotSupportedError(
            f"trainer engine {name!r} does not support wtcore bench: declare a "
            f"wtcore_bench.EngineBench for it in the {ENGINE_GROUP!r} entry-point group "
            "(see docs/writing-an-engine.md)"
        )
    return found


def find_client_bench(name: str, cls: type[Any] | None = None) -> ClientBench | None:
    """How the bench starts receivers for client ``name`` (class ``cls``); ``None``: undeclared."""
    found = _declared(CLIENT_GROUP, name)
    if found is None and cls is not None:
        target = _legacy(cls, "bench_launcher", CLIENT_GROUP)
        if isinstance(target, str):
            peers = getattr(cls, "bench_baselines", None)
            found = ClientBench(
                pkgutil.resolve_name(target),
                pkgutil.resolve_name(peers) if isinstance(peers, str) else {},
            )
    return _checked(found, ClientBench, f"client {name!r}: {CLIENT_GROUP}")


def client_bench(name: str, cls: type[Any] | None = None) -> ClientBench:
    """:func:`find_client_bench`, or an error that says how to declare it."""
    found = find_client_bench(name, cls)
    if found is None:
        raise BenchNotSupportedError(
            f"client {name!r} cannot start receivers for wtcore bench: declare a "
            f"wtcore_bench.ClientBench for it in the {CLIENT_GROUP!r} entry-point group "
            "(see docs/writing-an-engine.md)"
        )
    return found
