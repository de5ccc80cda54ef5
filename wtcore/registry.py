"""Lazy, entry-point backed registries of engines and clients (DESIGN §3).

Reading an entry-point group reads only package metadata; nothing is imported until a name is
:meth:`Registry.load`-ed. Errors follow fsspec: an unknown name lists what is installed,
suggests a close match and gives the ``pip install`` line; a plugin that fails to import is
reported with its distribution and version, the cause chained.
"""

from __future__ import annotations

import difflib
import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from wtcore.errors import PluginLoadError, PluginNotFoundError

__all__ = [
    "CLIENTS",
    "ENGINES",
    "FIRST_PARTY",
    "TRAINER_ENGINES",
    "PluginInfo",
    "Registry",
    "autoload_disabled",
]

T = TypeVar("T")

#: Names that first-party distributions provide, for the install hint.
FIRST_PARTY: dict[str, str] = {
    "nccl": "wtcore-nccl",
    "ipc": "wtcore-ipc",
    "http": "wtcore-http-client",
    "ray": "wtcore-ray-client",
}

_DISABLE_ENV = "WTCORE_DISABLE_PLUGIN_AUTOLOAD"


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


class Registry(Generic[T]):
    """Names -> classes for one entry-point group; classes must subclass ``base``."""

    def __init__(
        self,
        group: str,
        base: type[T] | str,
        kind: str,
        builtins: dict[str, str] | None = None,
    ) -> None:
        self.group = group
        self._builtins = {
            name: PluginInfo(name, target, "wtcore", _core_version())
            for name, target in (builtins or {}).items()
        }
        self._base = base
        self.kind = kind
        self._lock = threading.RLock()
        self._discovered: dict[str, PluginInfo] | None = None
        self._runtime: dict[str, PluginInfo] = {}
        self._objects: dict[str, Any] = {}

    # ------------------------------------------------------------------ discovery
    def _discover(self) -> dict[str, PluginInfo]:
        with self._lock:
            if self._discovered is None:
                found: dict[str, PluginInfo] = {}
                if not autoload_disabled():
                    from importlib.metadata import entry_points

                    for ep in entry_points(group=self.group):
                        dist = ep.dist
                        found.setdefault(
                            ep.name,
                            PluginInfo(
                                ep.name,
                                ep.value,
                                dist.name if dist is not None else None,
                                dist.version if dist is not None else None,
                            ),
                        )
                self._discovered = found
            return self._discovered

    def refresh(self) -> None:
        """Forget discovered entry points and loaded classes (after installing a plugin)."""
        with self._lock:
            self._discovered = None
            self._objects = {k: v for k, v in self._objects.items() if k in self._runtime}

    def _all(self) -> dict[str, PluginInfo]:
        return {**self._builtins, **self._discover(), **self._runtime}

    # ------------------------------------------------------------------ public API
    def names(self) -> list[str]:
        """Every registered name, sorted. Imports nothing."""
        return sorted(self._all())

    def info(self, name: str) -> PluginInfo:
        try:
            return self._all()[name]
        except KeyError:
            raise self._not_found(name) from None

    def register(self, name: str, target: str | type[T], *, replace: bool = False) -> None:
        """Register ``target`` (``"module:Class"`` or a class) under ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        with self._lock:
            existing = self._all().get(name)
            if existing is not None and not replace:
                raise ValueError(
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
        with self._lock:
            if name in self._objects:
                return self._objects[name]  # type: ignore[no-any-return]
            info = self.info(name)
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
            raise TypeError(
                f"{self.kind} {name!r}{where} must be a subclass of {base.__module__}."
                f"{base.__qualname__}, got {obj!r}"
            )

    def _not_found(self, name: str) -> PluginNotFoundError:
        names = sorted(self._all())
        installed = ", ".join(names) if names else "none"
        msg = f"unknown {self.kind} {name!r}; installed: {installed}."
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        dist = FIRST_PARTY.get(name)
        if dist is not None:
            msg += f" {name!r} is provided by {dist}: pip install {dist}"
        else:
            msg += (
                f" If it is a plugin, install it, e.g. pip install wtcore-{name.replace('_', '-')}"
            )
        if autoload_disabled():
            msg += f" (plugin discovery is off: {_DISABLE_ENV} is set)"
        return PluginNotFoundError(msg)


def _core_version() -> str:
    from wtcore._version import __version__

    return __version__


def _is_protocol(tp: type) -> bool:
    return bool(getattr(tp, "_is_protocol", False))


def _split_target(target: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must look like 'package.module:Class', got {target!r}")
    return module_name, attr


#: Worker (inference-side) engines, entry-point group ``wtcore.engines``.
ENGINES: Registry[Any] = Registry(
    "wtcore.engines",
    "wtcore.engine:WeightTransferEngine",
    "engine",
    builtins={"local": "wtcore.local:LocalWorkerEngine"},
)
#: Trainer engines, entry-point group ``wtcore.trainer_engines``.
TRAINER_ENGINES: Registry[Any] = Registry(
    "wtcore.trainer_engines",
    "wtcore.trainer:TrainerWeightTransferEngine",
    "trainer engine",
    builtins={"local": "wtcore.local:LocalTrainerEngine"},
)
#: Control-plane clients, entry-point group ``wtcore.clients``.
CLIENTS: Registry[Any] = Registry(
    "wtcore.clients",
    "wtcore.client:WeightSyncClient",
    "client",
    builtins={"inproc": "wtcore.inproc:InProcessClient"},
)
