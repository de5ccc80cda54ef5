"""Lazy, entry-point backed registries of engines, clients and round policies (docs/plugins.md).

Only :data:`FIRST_PARTY` names get an install hint: guessing ``pip install wtcore-<typo>``
would send users to whoever registers the typo.
"""

from __future__ import annotations

import difflib
import logging
import os
import pkgutil
import re
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from wtcore._version import __version__
from wtcore.errors import PayloadError, PluginLoadError

__all__ = [
    "CLIENTS",
    "ENGINES",
    "FIRST_PARTY",
    "RECEIVER_LAYERS",
    "ROUND_POLICIES",
    "TRAINER_ENGINES",
    "Halves",
    "PluginConflict",
    "PluginInfo",
    "Registry",
    "autoload_disabled",
]

T = TypeVar("T")
log = logging.getLogger("wtcore.registry")

#: First-party plugin names (entry-point group -> name -> distribution), for install hints only.
FIRST_PARTY: dict[str, dict[str, str]] = {
    "wtcore.backends": {"nccl": "wtcore-nccl", "tcp": "wtcore-tcp", "ipc": "wtcore-ipc"},
    "wtcore.clients": {"http": "wtcore-http-client", "ray": "wtcore-ray-client"},
    "wtcore.round_policies": {"delta": "wtcore-delta"},
    # ``wtcore`` subcommands, added through the ``wtcore_add_commands`` hook.
    "commands": {"bench": "wtcore-bench", "serve": "wtcore-http-client"},
}

_DISABLE_ENV = "WTCORE_DISABLE_PLUGIN_AUTOLOAD"
_UPGRADE_NOTES = 'CHANGELOG.md, 0.2.0, "For plugin authors"'


def autoload_disabled() -> bool:
    """True when ``WTCORE_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value."""
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Halves:
    """An engine's (or round policy's) two halves, each ``"module:Class"``."""

    trainer: str
    worker: str


@dataclass(frozen=True)
class PluginInfo:
    """Where a registered name comes from, known without importing it."""

    name: str
    target: str
    distribution: str | None = None
    version: str | None = None

    @property
    def origin(self) -> str:
        if self.distribution is None:
            return "registered at runtime"
        return f"{self.distribution} {self.version or '?'}"


@dataclass(frozen=True)
class PluginConflict:
    """One name claimed by several providers; ``providers[0]`` is the built-in, if any."""

    kind: str
    group: str
    name: str
    providers: tuple[PluginInfo, ...]
    builtin: bool = False

    @property
    def message(self) -> str:
        if self.builtin:
            core, others = self.providers[0], self.providers[1:]
            return (
                f"{self.kind} {self.name!r} is built into wtcore ({core.target}), and "
                f"{_listing(others)} also register{'s' if len(others) == 1 else ''} it in "
                f"{self.group}: a plugin may not shadow a built-in name, so it is ignored and "
                f"the built-in is used. Uninstall "
                f"{' and '.join(i.distribution or '?' for i in others)} or have its entry point "
                "renamed."
            )
        return (
            f"{self.kind} {self.name!r} is registered in {self.group} by "
            f"{len(self.providers)} distributions: {_listing(self.providers)}. Uninstall all "
            f"but one, or pick one in code with register({self.name!r}, target, replace=True)."
        )


def _listing(infos: Iterable[PluginInfo]) -> str:
    return " and ".join(f"{i.origin} ({i.target})" for i in infos)


def _dist_key(info: PluginInfo) -> str:
    """PEP 503 normalised distribution name: one distribution seen twice is no conflict."""
    if info.distribution is None:
        return f"?{info.target}"
    return re.sub(r"[-_.]+", "-", info.distribution).lower()


class Registry(Generic[T]):
    """Names -> classes for one entry-point group; classes must subclass ``base``. With
    ``half``, a :class:`Halves` record gives that half; ``old_group`` is 0.1.0's (deprecated)."""

    def __init__(
        self,
        group: str,
        base: type[T] | str,
        kind: str,
        builtins: dict[str, str] | None = None,
        renamed: dict[str, str] | None = None,
        half: str | None = None,
        old_group: str | None = None,
    ) -> None:
        self.group, self.kind, self.half, self.old_group = group, kind, half, old_group
        #: Renamed built-ins, old -> new (the old name warns until 0.3).
        self.renamed = dict(renamed or {})
        self._builtins = {
            name: PluginInfo(name, target, "wtcore", __version__)
            for name, target in (builtins or {}).items()
        }
        self._base = base
        self._lock = threading.RLock()
        self._discovered: dict[str, PluginInfo] | None = None
        self._conflicts: dict[str, PluginConflict] = {}
        self._runtime: dict[str, PluginInfo] = {}
        self._objects: dict[str, Any] = {}
        self._warned: set[str] = set()

    def _discover(self) -> dict[str, PluginInfo]:
        with self._lock:
            if self._discovered is None:
                from importlib.metadata import entry_points

                claims = {name: {_dist_key(info): info} for name, info in self._builtins.items()}
                groups = () if autoload_disabled() else (self.group, self.old_group)
                for group in filter(None, groups):
                    for ep in entry_points(group=group):
                        d = ep.dist
                        info = PluginInfo(ep.name, ep.value, *((d.name, d.version) if d else ()))
                        # first seen wins within one distribution (sys.path order, as import):
                        # its record before its 0.1.0 declaration
                        by_dist = claims.setdefault(ep.name, {})
                        first = by_dist.setdefault(_dist_key(info), info) is info
                        if first and d and group == self.old_group:
                            _warn_old(ep, self.group)
                found: dict[str, PluginInfo] = {}
                self._conflicts = {}
                for name, by_dist in claims.items():
                    providers = tuple(by_dist.values())
                    core = self._builtins.get(self.renamed.get(name, ""))
                    if core is not None:  # a renamed built-in's old name: still reserved
                        self._conflicts[name] = PluginConflict(
                            self.kind, self.group, name, (core, *providers), True
                        )
                        continue
                    found[name] = providers[0]
                    if len(providers) > 1:
                        self._conflicts[name] = PluginConflict(
                            self.kind, self.group, name, providers, name in self._builtins
                        )
                self._discovered = found
            return self._discovered

    def refresh(self) -> None:
        """Forget discovered entry points and loaded classes (after installing a plugin)."""
        with self._lock:
            self._discovered = None
            _warned_old.clear()
            self._objects = {k: v for k, v in self._objects.items() if k in self._runtime}

    def _all(self) -> dict[str, PluginInfo]:
        return {**self._discover(), **self._runtime}

    def names(self) -> list[str]:
        """Every registered name, conflicting ones included, sorted. Imports nothing."""
        return sorted(self._all())

    def conflicts(self) -> list[PluginConflict]:
        """Names claimed twice (or shadowing a built-in); a runtime ``register`` settles one."""
        with self._lock:
            self._discover()
            return [c for n, c in sorted(self._conflicts.items()) if n not in self._runtime]

    def resolve(self, name: str) -> str:
        """The current name for ``name``: a renamed built-in's old name warns, gives the new."""
        return self._resolve(name)

    def _resolve(self, name: str) -> str:
        new = self.renamed.get(name)
        if new is None or name in self._runtime:
            return name
        warnings.warn(
            f"{self.kind} {name!r} was renamed {new!r}; the old name will be removed in 0.3",
            DeprecationWarning,
            stacklevel=3,
        )
        return new

    def info(self, name: str) -> PluginInfo:
        """Where ``name`` comes from; a conflicting name raises :class:`PluginLoadError`."""
        return self._info(self._resolve(name))

    def _info(self, name: str) -> PluginInfo:
        with self._lock:
            found = self._all().get(name)
            if found is None:
                raise self._not_found(name)
            conflict = self._conflicts.get(name) if name not in self._runtime else None
            if conflict is not None and not conflict.builtin:
                raise PluginLoadError(conflict.message, "conflict")
            if conflict is not None and name not in self._warned:
                # the built-in wins, said once; `wtcore plugins` lists the conflict (exit 1)
                self._warned.add(name)
                log.warning("%s", conflict.message)
            return found

    def register(self, name: str, target: str | type[T], *, replace: bool = False) -> None:
        """Register ``target`` (``"module:Class"`` or a class) under ``name``."""
        if not isinstance(name, str) or not name:
            raise PayloadError(f"{self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            existing = self._all().get(self.renamed.get(name, name))
            if existing is not None and not replace:
                raise PluginLoadError(
                    f"{self.kind} {name!r} is already registered ({existing.target}, "
                    f"{existing.origin}); pass replace=True to override it",
                    "conflict",
                )
            if isinstance(target, str):
                _split_target(target)
                self._runtime[name] = PluginInfo(name, target)
                self._objects.pop(name, None)
            else:
                self._check_base(name, target, None)
                self._runtime[name] = PluginInfo(name, f"{target.__module__}:{target.__qualname__}")
                self._objects[name] = target

    def unregister(self, name: str) -> None:
        """Remove a runtime registration (entry points stay discoverable)."""
        with self._lock:
            self._runtime.pop(name, None)
            self._objects.pop(name, None)

    def load(self, name: str) -> type[T]:
        """Import and return the class registered under ``name``."""
        name = self._resolve(name)
        with self._lock:
            if name in self._objects:
                return self._objects[name]  # type: ignore[no-any-return]
            info = self._info(name)
            target = info.target
            try:
                obj = _import(target)
                if self.half is not None and isinstance(obj, Halves):
                    target = getattr(obj, self.half)  # this half's module only
                    obj = _import(target)
            except Exception as e:
                where = info.origin if info.distribution else f"target {info.target}"
                raise PluginLoadError(
                    f"{self.kind} {name!r} from {where} failed to import "
                    f"{target}: {type(e).__name__}: {e}"
                ) from e
            self._check_base(name, obj, info)
            self._objects[name] = obj
            return obj  # type: ignore[no-any-return]

    def _check_base(self, name: str, obj: object, info: PluginInfo | None) -> None:
        base = self._base = _import(self._base) if isinstance(self._base, str) else self._base
        where = info.origin if info and info.distribution else ""
        if getattr(base, "_is_protocol", False):  # a protocol: its methods, nothing required
            members = [m for m in vars(base) if not m.startswith("_") and callable(vars(base)[m])]
            ok = isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in members)
            missing = []
        else:
            ok = isinstance(obj, type) and issubclass(obj, base)
            missing = _missing_methods(obj) if ok and isinstance(obj, type) else []
        if not ok:
            raise PluginLoadError(
                f"{self.kind} {name!r}{f' ({where})' if where else ''} must be a subclass of "
                f"{base.__module__}.{base.__qualname__}, got {obj!r}",
                "wrong-type",
            )
        if missing:
            assert isinstance(obj, type)
            where += ", " if where else ""
            raise PluginLoadError(
                f"{self.kind} {name!r} ({where}{obj.__module__}:{obj.__qualname__}) does not "
                f"implement {' and '.join(missing)}, which wtcore {__version__} requires "
                f"of every {self.kind}; it was probably written for an older wtcore. What to "
                f"change: see {_UPGRADE_NOTES}",
                "api",
            )

    def _not_found(self, name: str) -> PluginLoadError:
        installed = sorted(self._all())
        first_party = FIRST_PARTY.get(self.group, {})
        msg = f"unknown {self.kind} {name!r}; installed: {', '.join(installed) or 'none'}."
        if name in first_party:
            msg += f" {name!r} is provided by {first_party[name]}: pip install {first_party[name]}"
        else:
            candidates = sorted({*installed, *first_party, *self.renamed})
            close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
            if close:
                guess = self.renamed.get(close[0], close[0])  # a typo of an old name: the new
                msg += f" Did you mean {guess!r}?"
                if guess not in installed:
                    dist = first_party[guess]
                    msg += f" It is provided by {dist}: pip install {dist}"
        if autoload_disabled():
            msg += f" (plugin discovery is off: {_DISABLE_ENV} is set)"
        return PluginLoadError(msg, "not-found")


def _missing_methods(cls: type) -> list[str]:
    """What ``cls`` lacks (from class attributes only): abstract methods, and each base's
    ``required_methods`` entry that no class below it defines."""
    missing = [f"{m}()" for m in sorted(getattr(cls, "__abstractmethods__", ()))]
    for depth, declaring in enumerate(cls.__mro__):
        required = vars(declaring).get("required_methods")
        for method, alternatives in required.items() if isinstance(required, Mapping) else ():
            below = cls.__mro__[:depth]
            if not any(n in vars(k) for k in below for n in (method, *alternatives)):
                instead = " or ".join(f"override {a}()" for a in alternatives)
                missing.append(f"{method}() (or {instead})" if instead else f"{method}()")
    return missing


def _import(target: str) -> Any:
    _split_target(target)
    return pkgutil.resolve_name(target)


#: 0.1.0's engine groups (worker, trainer), read until 0.3 with one warning per engine.
_OLD_GROUPS = ("wtcore.engines", "wtcore.trainer_engines")
_warned_old: set[tuple[str, str]] = set()


def _warn_old(ep: Any, group: str) -> None:
    """Name the record to declare instead of 0.1.0's two classes, once per engine."""
    if (ep.dist.name, ep.name) not in _warned_old:
        _warned_old.add((ep.dist.name, ep.name))
        old = {e.group: e.value for e in ep.dist.entry_points if e.name == ep.name}
        worker, trainer = (old.get(g, "module:Class") for g in _OLD_GROUPS)
        package = worker.split(":")[0].split(".")[0]
        message = (
            f"{ep.dist.name} {ep.dist.version} registers engine {ep.name!r} in 0.1.0's groups "
            f"{' and '.join(_OLD_GROUPS)}, read until 0.3 only: declare it once, "
            f'[project.entry-points."{group}"] {ep.name} = "{package}:ENGINE", with ENGINE = '
            f'wtcore.registry.Halves(trainer="{trainer}", worker="{worker}") in {package}'
        )
        warnings.warn(message, DeprecationWarning, stacklevel=2)


def _split_target(target: str) -> None:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PayloadError(f"target must look like 'package.module:Class', got {target!r}")


_FULL = "wtcore.trainer:RoundPolicy"
#: Worker (inference-side) engines: the worker halves of ``wtcore.backends``.
ENGINES: Registry[Any] = Registry(
    "wtcore.backends",
    "wtcore.engine:WeightTransferEngine",
    "engine",
    builtins={"inline": "wtcore_kit.inline:InlineWorkerEngine"},
    renamed={"local": "inline"},
    half="worker",
    old_group=_OLD_GROUPS[0],
)
#: Trainer engines: the trainer halves of ``wtcore.backends``.
TRAINER_ENGINES: Registry[Any] = Registry(
    "wtcore.backends",
    "wtcore.trainer:TrainerWeightTransferEngine",
    "trainer engine",
    builtins={"inline": "wtcore_kit.inline:InlineTrainerEngine"},
    renamed={"local": "inline"},
    half="trainer",
    old_group=_OLD_GROUPS[1],
)
#: Control-plane clients, entry-point group ``wtcore.clients``.
CLIENTS: Registry[Any] = Registry(
    "wtcore.clients",
    "wtcore.client:WeightSyncClient",
    "client",
    builtins={"inproc": "wtcore_kit.inproc:InProcessClient"},
)
#: What a sender's rounds send (``TrainerInitInfo.rounds``; ``delta`` is wtcore-delta's).
ROUND_POLICIES: Registry[Any] = Registry(
    "wtcore.round_policies", _FULL, "round policy", builtins={"full": _FULL}, half="trainer"
)
#: The receiver halves of ``wtcore.round_policies``, first in every worker's sink chain.
RECEIVER_LAYERS: Registry[Any] = Registry(
    "wtcore.round_policies", "wtcore.worker:ReceiverLayer", "receiver layer", half="worker"
)
