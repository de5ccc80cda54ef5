"""The plugin manager for hooks, built on first use (``import wtcore`` stays cheap).

An observer that raises is logged and skipped: a metrics plugin must never break a weight sync.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pluggy

from wtcore.errors import PluginLoadError
from wtcore.registry import autoload_disabled

__all__ = [
    "get_plugin_manager",
    "hook_load_errors",
    "hook_plugin_origins",
    "notify",
    "register_hooks",
    "unregister_hooks",
]

GROUP = "wtcore.hooks"
log = logging.getLogger("wtcore.hooks")

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None
_errors: list[PluginLoadError] = []
_origins: dict[str, str] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading ``wtcore.hooks`` entry points once."""
    global _pm
    with _lock:
        if _pm is None:
            from wtcore import hookspecs

            pm = pluggy.PluginManager("wtcore")
            pm.add_hookspecs(hookspecs)
            if not autoload_disabled():
                _load_entry_points(pm)
            _pm = pm
        return _pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=GROUP):
        d = ep.dist
        dist = f"{d.name} {d.version}" if d is not None else "unknown distribution"
        try:
            pm.register(ep.load(), name=ep.name)
            _origins[ep.name] = dist
        except Exception as e:
            err = PluginLoadError(
                f"hook plugin {ep.name!r} from {dist} failed to load {ep.value}: "
                f"{type(e).__name__}: {e}"
            )
            err.__cause__ = e
            _errors.append(err)
            log.warning("%s", err)


def hook_load_errors() -> list[PluginLoadError]:
    """Hook plugins that failed to load, with their distribution named."""
    get_plugin_manager()
    return list(_errors)


def hook_plugin_origins() -> dict[str, str]:
    """``{name: "distribution version"}`` of hook plugins loaded from entry points."""
    get_plugin_manager()
    return dict(_origins)


def register_hooks(plugin: object, name: str | None = None) -> str:
    """Register a hook implementation object or module explicitly; returns its name."""
    try:
        registered = get_plugin_manager().register(plugin, name=name)
    except ValueError as e:  # pluggy's own error for a name or object registered twice
        raise PluginLoadError(
            f"hook plugin {name or plugin!r} is already registered", "conflict"
        ) from e
    if registered is None:
        raise PluginLoadError(f"hook plugin {name or plugin!r} is blocked", "conflict")
    return registered


def unregister_hooks(plugin: object | None = None, name: str | None = None) -> None:
    get_plugin_manager().unregister(plugin, name=name)


def reset() -> None:
    """Drop the plugin manager (tests that add entry points use this)."""
    global _pm
    with _lock:
        _pm = None
        _errors.clear()
        _origins.clear()


def notify(hook: str, **kwargs: Any) -> None:
    """Call every observer of ``hook``; an observer's exception is logged, never raised."""
    pm = get_plugin_manager()
    caller = getattr(pm.hook, hook)
    for impl in caller.get_hookimpls():
        try:
            impl.function(**{k: kwargs[k] for k in impl.argnames})
        except Exception:
            log.exception("hook %s of plugin %r raised; ignored", hook, impl.plugin_name)
