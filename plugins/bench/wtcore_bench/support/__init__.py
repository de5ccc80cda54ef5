"""Which engines and clients the bench can drive, found by their registered names:
``engine.<name>`` / ``client.<name>`` in the entry-point group ``wtcore.bench``, or
:func:`register_engine_bench` / :func:`register_client_bench` in code. The old class attributes
(``bench``, ``bench_launcher``, ``bench_baselines``) work with a warning until 0.3.
"""

from __future__ import annotations

import dataclasses
import pkgutil
import warnings
from typing import Any, TypeVar

from wtcore.registry import TRAINER_ENGINES, autoload_disabled
from wtcore_bench.api import BenchNotSupportedError, ClientBench, EngineBench

__all__ = [
    "DEFAULT_ENGINE_BENCH",
    "GROUP",
    "client_bench",
    "engine_bench",
    "find_client_bench",
    "find_engine_bench",
    "register_client_bench",
    "register_engine_bench",
]

T = TypeVar("T")
GROUP = "wtcore.bench"

#: Registered in code, by entry-point name.
_explicit: dict[str, Any] = {}


def register_engine_bench(name: str, bench: EngineBench | None) -> None:
    """How engine ``name`` runs in the bench (``None`` forgets it)."""
    _register(f"engine.{name}", bench)


def register_client_bench(name: str, bench: ClientBench | None) -> None:
    """How the bench starts receivers for client ``name`` (``None`` forgets it)."""
    _register(f"client.{name}", bench)


def _register(key: str, value: object | None) -> None:
    _explicit.pop(key, None)
    if value is not None:
        _explicit[key] = value


def _declared(key: str) -> Any:
    if key in _explicit:
        return _explicit[key]
    if autoload_disabled():
        return None
    from importlib.metadata import entry_points

    for ep in entry_points(group=GROUP, name=key):
        try:
            return ep.load()
        except Exception as e:  # a broken plugin is this name's problem, not the run's
            raise BenchNotSupportedError(
                f"{GROUP} entry point {key!r} ({ep.value}) failed to load: {type(e).__name__}: {e}"
            ) from e
    return None


def _legacy(owner: type[Any], attr: str, key: str) -> Any:
    value = getattr(owner, attr, None)
    if value is not None:
        warnings.warn(
            f"{owner.__qualname__}.{attr} is deprecated and will be removed in 0.3: declare the "
            f"bench support as {key!r} in the {GROUP!r} entry-point group (CHANGELOG, 0.2.0, "
            '"For plugin authors")',
            DeprecationWarning,
            stacklevel=3,
        )
    return value


def _checked(found: Any, kind: type[T], where: str) -> T | None:
    if found is None or isinstance(found, kind):
        return found
    raise BenchNotSupportedError(
        f"{where} names a {type(found).__name__}, not a wtcore_bench.{kind.__name__}"
    )


def find_engine_bench(name: str, cls: type[Any] | None = None) -> EngineBench | None:
    """How engine ``name`` runs in the bench; ``None``: undeclared."""
    found = _declared(f"engine.{name}")
    if found is None and name in TRAINER_ENGINES.renamed:  # an old name, with a warning
        found = _declared(f"engine.{TRAINER_ENGINES.resolve(name)}")
    if found is None and cls is not None:
        found = _legacy(cls, "bench", f"engine.{name}")
    return _checked(found, EngineBench, f"engine {name!r}: {GROUP} engine.{name}")


#: What an engine that declares nothing runs with.
DEFAULT_ENGINE_BENCH = EngineBench()


def engine_bench(name: str, cls: type[Any] | None = None) -> EngineBench:
    """:func:`find_engine_bench`, else the default if ``cls``'s init info needs nothing more."""
    found = find_engine_bench(name, cls)
    if found is not None:
        return found
    info_cls: Any = getattr(cls, "init_info_cls", None)
    fields = dataclasses.fields(info_cls) if dataclasses.is_dataclass(info_cls) else ()
    missing = dataclasses.MISSING
    unset = [
        f.name
        for f in fields
        if f.init and f.name != "rank" and f.default is missing and f.default_factory is missing
    ]
    if unset:
        raise BenchNotSupportedError(
            f"trainer engine {name!r} declares no bench support, and the bench cannot guess "
            f"{', '.join(unset)} of its {info_cls.__name__}: declare a wtcore_bench.EngineBench "
            f"whose init_info sets them as 'engine.{name}' in the {GROUP!r} entry-point group "
            "(see docs/writing-an-engine.md)"
        )
    return DEFAULT_ENGINE_BENCH


def find_client_bench(name: str, cls: type[Any] | None = None) -> ClientBench | None:
    """How the bench starts receivers for client ``name``; ``None``: undeclared."""
    found = _declared(f"client.{name}")
    if found is None and cls is not None:
        target = _legacy(cls, "bench_launcher", f"client.{name}")
        if isinstance(target, str):
            peers = getattr(cls, "bench_baselines", None)
            found = ClientBench(
                pkgutil.resolve_name(target),
                pkgutil.resolve_name(peers) if isinstance(peers, str) else {},
            )
    return _checked(found, ClientBench, f"client {name!r}: {GROUP} client.{name}")


def client_bench(name: str, cls: type[Any] | None = None) -> ClientBench:
    found = find_client_bench(name, cls)
    if found is None:
        raise BenchNotSupportedError(
            f"client {name!r} cannot start receivers for wtcore bench: declare a "
            f"wtcore_bench.ClientBench for it as 'client.{name}' in the {GROUP!r} entry-point "
            "group (see docs/writing-an-engine.md)"
        )
    return found
