"""Lazy, entry-point backed registries of engines and clients (see docs/plugins.md).

Reading an entry-point group reads only package metadata; nothing is imported until a name is
:meth:`Registry.load`-ed. Errors follow fsspec: an unknown name lists what is installed and
suggests a close match; a plugin that fails to import is reported with its distribution and
version, the cause chained.

A renamed built-in keeps its old name for one release (``renamed``, old -> new): it resolves to
the new name with a ``DeprecationWarning``.

Two rules keep a name meaning one thing. Two distributions registering one name is a
:class:`~wtcore.errors.PluginConflictError` naming both when that name is used (never a silent
winner chosen by discovery order), and no distribution may register a built-in name, an old
one included. An install line is suggested only for names in :data:`FIRST_PARTY`: guessing
``pip install wtcore-<typo>`` would send users to whoever registers the typo on the package
index.

An engine class is also checked against the engine API it is registered for, from its class
attributes alone (nothing is instantiated): every abstract method and every method its bases
list in ``required_methods`` must be defined. An engine written for an older wtcore is then a
:class:`~wtcore.errors.PluginAPIError` naming what to add, when it is registered or first
loaded, instead of a failure deep in a round.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from wtcore.errors import (
    PayloadError,
    PluginAPIError,
    PluginConflictError,
    PluginLoadError,
    PluginNotFoundError,
    PluginTypeError,
)

__all__ = [
    "CLIENTS",
    "ENGINES",
    "FIRST_PARTY",
    "RECEIVER_LAYERS",
    "ROUND_POLICIES",
    "TRAINER_ENGINES",
    "PluginConflict",
    "PluginInfo",
    "Registry",
    "autoload_disabled",
]

T = TypeVar("T")
log = logging.getLogger("wtcore.registry")

#: The one table of first-party plugin names (entry-point group -> name -> distribution), used
#: only for install hints: no other distribution name is ever suggested.
FIRST_PARTY: dict[str, dict[str, str]] = {
    "wtcore.engines": {"nccl": "wtcore-nccl", "tcp": "wtcore-tcp", "ipc": "wtcore-ipc"},
    "wtcore.trainer_engines": {"nccl": "wtcore-nccl", "tcp": "wtcore-tcp", "ipc": "wtcore-ipc"},
    "wtcore.clients": {"http": "wtcore-http-client", "ray": "wtcore-ray-client"},
    "wtcore.round_policies": {"delta": "wtcore-delta"},
    "wtcore.receiver_layers": {"delta": "wtcore-delta"},
    # ``wtcore`` subcommands, added through the ``wtcore_add_commands`` hook.
    "commands": {"bench": "wtcore-bench", "serve": "wtcore-http-client"},
}

_DISABLE_ENV = "WTCORE_DISABLE_PLUGIN_AUTOLOAD"
_CORE_DIST = "wtcore"
#: Where a plugin author reads what changed in the engine API (named by PluginAPIError).
_UPGRADE_NOTES = 'CHANGELOG.md, 0.2.0, "For plugin authors"'


def autoload_disabled() -> bool:
    """True when ``WTCORE_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value."""
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


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
                f"the built-in is used. Uninstall {_names(others)} or have its entry point "
                "renamed."
            )
        return (
            f"{self.kind} {self.name!r} is registered in {self.group} by "
            f"{len(self.providers)} distributions: {_listing(self.providers)}. Uninstall all "
            f"but one, or pick one in code with register({self.name!r}, target, replace=True)."
        )

    def error(self) -> PluginConflictError:
        return PluginConflictError(self.message)


def _listing(infos: Iterable[PluginInfo]) -> str:
    return " and ".join(f"{i.origin} ({i.target})" for i in infos)


def _names(infos: Iterable[PluginInfo]) -> str:
    return " and ".join(i.distribution or "?" for i in infos)


def _dist_key(info: PluginInfo) -> str:
    """PEP 503 normalised distribution name: one distribution seen twice is no conflict."""
    if info.distribution is None:
        return f"?{info.target}"
    return re.sub(r"[-_.]+", "-", info.distribution).lower()


class Registry(Generic[T]):
    """Names -> classes for one entry-point group; classes must subclass ``base``."""

    def __init__(
        self,
        group: str,
        base: type[T] | str,
        kind: str,
        builtins: dict[str, str] | None = None,
        renamed: dict[str, str] | None = None,
    ) -> None:
        self.group = group
        #: Old name -> new name of renamed built-ins: the old one still resolves, with a
        #: ``DeprecationWarning``, for one release (CHANGELOG, 0.2.0).
        self.renamed = dict(renamed or {})
        self._builtins = {
            name: PluginInfo(name, target, _CORE_DIST, _core_version())
            for name, target in (builtins or {}).items()
        }
        self._base = base
        self.kind = kind
        self._lock = threading.RLock()
        self._discovered: dict[str, PluginInfo] | None = None
        self._conflicts: dict[str, PluginConflict] = {}
        self._runtime: dict[str, PluginInfo] = {}
        self._objects: dict[str, Any] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ discovery
    def _discover(self) -> dict[str, PluginInfo]:
        with self._lock:
            if self._discovered is None:
                claims: dict[str, dict[str, PluginInfo]] = {}
                for name, info in self._builtins.items():
                    claims[name] = {_dist_key(info): info}
                if not autoload_disabled():
                    from importlib.metadata import entry_points

                    for ep in entry_points(group=self.group):
                        dist = ep.dist
                        info = PluginInfo(
                            ep.name,
                            ep.value,
                            dist.name if dist is not None else None,
                            dist.version if dist is not None else None,
                        )
                        # first seen wins within one distribution: sys.path order, as import
                        claims.setdefault(ep.name, {}).setdefault(_dist_key(info), info)
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
            self._objects = {k: v for k, v in self._objects.items() if k in self._runtime}

    def _all(self) -> dict[str, PluginInfo]:
        return {**self._discover(), **self._runtime}

    # ------------------------------------------------------------------ public API
    def names(self) -> list[str]:
        """Every registered name, conflicting ones included, sorted. Imports nothing."""
        return sorted(self._all())

    def conflicts(self) -> list[PluginConflict]:
        """Names claimed by several distributions (or shadowing a built-in), sorted by name.

        A runtime :meth:`register` with ``replace=True`` settles a conflict explicitly.
        """
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
        """Where ``name`` comes from; a conflicting name raises :class:`PluginConflictError`."""
        return self._info(self._resolve(name))

    def _info(self, name: str) -> PluginInfo:
        with self._lock:
            found = self._all().get(name)
            if found is None:
                raise self._not_found(name)
            conflict = self._conflicts.get(name) if name not in self._runtime else None
            if conflict is not None and conflict.builtin:
                # The built-in wins (a plugin must not break it); said once, and listed by
                # `wtcore plugins` as a conflict (exit 1).
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("%s", conflict.message)
                return found
            if conflict is not None:
                raise conflict.error()
            return found

    def register(self, name: str, target: str | type[T], *, replace: bool = False) -> None:
        """Register ``target`` (``"module:Class"`` or a class) under ``name``."""
        if not isinstance(name, str) or not name:
            raise PayloadError(f"{self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            existing = self._all().get(self.renamed.get(name, name))
            if existing is not None and not replace:
                raise PluginConflictError(
                    f"{self.kind} {name!r} is already registered ({existing.target}, "
                    f"{existing.origin}); pass replace=True to override it"
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
            module_name, attr = _split_target(info.target)
            try:
                module = importlib.import_module(module_name)
                obj = module
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as e:
                where = info.origin if info.distribution else f"target {info.target}"
                raise PluginLoadError(
                    f"{self.kind} {name!r} from {where} failed to import "
                    f"{info.target}: {type(e).__name__}: {e}"
                ) from e
            self._check_base(name, obj, info)
            self._objects[name] = obj
            return obj  # type: ignore[return-value]

    # ------------------------------------------------------------------ helpers
    def base(self) -> type:
        if isinstance(self._base, str):
            module_name, attr = _split_target(self._base)
            self._base = getattr(importlib.import_module(module_name), attr)
        assert isinstance(self._base, type)
        return self._base

    def _check_base(self, name: str, obj: object, info: PluginInfo | None) -> None:
        base = self.base()
        if not isinstance(obj, type):
            ok = False
        elif _is_protocol(base):
            members = [m for m in vars(base) if not m.startswith("_") and callable(vars(base)[m])]
            ok = all(callable(getattr(obj, m, None)) for m in members)
        else:
            ok = issubclass(obj, base)
        if not ok:
            where = f" ({info.origin})" if info and info.distribution else ""
            raise PluginTypeError(
                f"{self.kind} {name!r}{where} must be a subclass of {base.__module__}."
                f"{base.__qualname__}, got {obj!r}"
            )
        assert isinstance(obj, type)
        missing = [] if _is_protocol(base) else _missing_methods(obj)
        if missing:
            where = f"{info.origin}, " if info and info.distribution else ""
            raise PluginAPIError(
                f"{self.kind} {name!r} ({where}{obj.__module__}:{obj.__qualname__}) does not "
                f"implement {' and '.join(missing)}, which wtcore {_core_version()} requires "
                f"of every {self.kind}; it was probably written for an older wtcore. What to "
                f"change: see {_UPGRADE_NOTES}"
            )

    def _not_found(self, name: str) -> PluginNotFoundError:
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
        return PluginNotFoundError(msg)


def _core_version() -> str:
    from wtcore._version import __version__

    return __version__


def _missing_methods(cls: type) -> list[str]:
    """What ``cls`` lacks to be a concrete engine, read from class attributes only.

    Its abstract methods, then each entry of a ``required_methods`` mapping declared by a
    class in its MRO (``{method: alternatives}``) that neither the method nor one of its
    alternatives is defined for, below the class that declared it. Each is spelled
    ``name()``, with its alternatives: ``worker_init_info() (or override handshake())``.
    """
    missing = [f"{m}()" for m in sorted(getattr(cls, "__abstractmethods__", ()))]
    mro = cls.__mro__
    for depth, declaring in enumerate(mro):
        required = vars(declaring).get("required_methods")
        if not isinstance(required, Mapping):
            continue
        below = mro[:depth]
        for method, alternatives in required.items():
            if not any(n in vars(k) for k in below for n in (method, *alternatives)):
                instead = " or ".join(f"override {a}()" for a in alternatives)
                missing.append(f"{method}() (or {instead})" if instead else f"{method}()")
    return missing


def _is_protocol(tp: type) -> bool:
    return bool(getattr(tp, "_is_protocol", False))


def _split_target(target: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PayloadError(f"target must look like 'package.module:Class', got {target!r}")
    return module_name, attr


#: Worker (inference-side) engines, entry-point group ``wtcore.engines``.
ENGINES: Registry[Any] = Registry(
    "wtcore.engines",
    "wtcore.engine:WeightTransferEngine",
    "engine",
    builtins={"inline": "wtcore_kit.inline:InlineWorkerEngine"},
    renamed={"local": "inline"},
)
#: Trainer engines, entry-point group ``wtcore.trainer_engines``.
TRAINER_ENGINES: Registry[Any] = Registry(
    "wtcore.trainer_engines",
    "wtcore.trainer:TrainerWeightTransferEngine",
    "trainer engine",
    builtins={"inline": "wtcore_kit.inline:InlineTrainerEngine"},
    renamed={"local": "inline"},
)
#: Control-plane clients, entry-point group ``wtcore.clients``.
CLIENTS: Registry[Any] = Registry(
    "wtcore.clients",
    "wtcore.client:WeightSyncClient",
    "client",
    builtins={"inproc": "wtcore_kit.inproc:InProcessClient"},
)
#: What a sender's rounds send (``TrainerInitInfo.rounds``), entry-point group
#: ``wtcore.round_policies``: named here so that the trainer never imports a policy's module.
#: ``delta`` comes from wtcore-delta.
ROUND_POLICIES: Registry[Any] = Registry(
    "wtcore.round_policies",
    "wtcore.trainer:RoundPolicy",
    "round policy",
    builtins={"full": "wtcore.trainer:RoundPolicy"},
)
#: The receiver halves of round policies, by policy name, entry-point group
#: ``wtcore.receiver_layers``: every worker puts each installed one first in its sink chain.
RECEIVER_LAYERS: Registry[Any] = Registry(
    "wtcore.receiver_layers",
    "wtcore.worker:ReceiverLayer",
    "receiver layer",
)
