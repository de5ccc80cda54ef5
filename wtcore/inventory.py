"""``wtcore plugins``: one plain-JSON record (docs/plugins.md) is both ``--json`` and the
table, so they never disagree. Listing imports every class (to find broken ones)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

__all__ = ["SCHEMA", "collect", "render"]

SCHEMA = 1


def collect() -> dict[str, Any]:
    """The record: every registry's plugins and conflicts, hook plugins, and an overall ``ok``."""
    from wtcore.hooks import get_plugin_manager, hook_load_errors, hook_plugin_origins
    from wtcore.registry import CLIENTS, ENGINES, TRAINER_ENGINES, Registry, autoload_disabled

    registries: list[dict[str, Any]] = []
    registry: Registry[Any]
    for title, registry in (
        ("engines", ENGINES),
        ("trainer engines", TRAINER_ENGINES),
        ("clients", CLIENTS),
    ):
        conflicts = registry.conflicts()
        conflicting = {c.name for c in conflicts}
        plugins = []
        for name in registry.names():
            if name in conflicting:
                continue
            info = registry.info(name)
            ok, status = _host_status(registry, name)
            plugins.append({**asdict(info), "origin": info.origin, "ok": ok, "status": status})
        registries.append(
            {
                "title": title,
                "kind": registry.kind,
                "group": registry.group,
                "plugins": plugins,
                "conflicts": [
                    {
                        "name": c.name,
                        "builtin": c.builtin,
                        "providers": [
                            {k: getattr(p, k) for k in ("distribution", "version", "target")}
                            for p in c.providers
                        ],
                        "message": c.message,
                    }
                    for c in conflicts
                ],
                "renamed": [{"name": o, "new": n} for o, n in sorted(registry.renamed.items())],
            }
        )
    origins = hook_plugin_origins()
    pm = get_plugin_manager()
    hooks = {
        "group": "wtcore.hooks",
        "plugins": [
            {"name": n, "origin": origins.get(n, "registered at runtime")}
            for n, _ in pm.list_name_plugin()
            if n is not None
        ],
        "errors": [str(e) for e in hook_load_errors()],
    }
    ok = not hooks["errors"] and all(
        not r["conflicts"] and all(p["ok"] for p in r["plugins"]) for r in registries
    )
    return {
        "schema": SCHEMA,
        "ok": ok,
        "discovery": not autoload_disabled(),
        "registries": registries,
        "hooks": hooks,
    }


def _host_status(registry: Any, name: str) -> tuple[bool, str]:
    """``(ok, text)``: a class that fails to import, or whose probe raises, is broken."""
    try:
        cls = registry.load(name)
    except Exception as e:
        return False, f"BROKEN: {e}"
    status = getattr(cls, "host_status", None)
    if not callable(status):
        return True, "available"
    try:
        return True, str(status())
    except Exception as e:
        return False, f"BROKEN: host_status() raised {type(e).__name__}: {e}"


def render(record: dict[str, Any]) -> list[str]:
    """The table, one line per entry; columns as wide as the longest name and origin."""
    registries: list[dict[str, Any]] = record["registries"]
    hooks: dict[str, Any] = record["hooks"]
    names = [h["name"] for h in hooks["plugins"]]
    for k in ("plugins", "conflicts", "renamed"):
        names += [e["name"] for r in registries for e in r[k]]
    name_w = max([len(n) for n in names] + [len("BROKEN")])
    origin_w = max([len(p["origin"]) for r in registries for p in r["plugins"]] + [0])

    lines: list[str] = []
    if not record["discovery"]:
        lines.append("plugin discovery is off (WTCORE_DISABLE_PLUGIN_AUTOLOAD is set)")
    for r in registries:
        lines.append(f"{r['title']} ({r['group']}):")
        for p in r["plugins"]:
            lines.append(f"  {p['name']:<{name_w}}  {p['origin']:<{origin_w}}  {p['status']}")
        for c in r["conflicts"]:
            lines.append(f"  {c['name']:<{name_w}}  CONFLICT: {c['message']}")
        for a in r["renamed"]:
            lines.append(f"  {a['name']:<{name_w}}  deprecated name of {a['new']!r} (until 0.3)")
        if not r["plugins"] and not r["conflicts"]:
            lines.append("  (none)")
    lines.append(f"hook plugins ({hooks['group']}):")
    for h in hooks["plugins"]:
        lines.append(f"  {h['name']:<{name_w}}  {h['origin']}")
    for err in hooks["errors"]:
        lines.append(f"  {'BROKEN':<{name_w}}  {err}")
    if not hooks["plugins"] and not hooks["errors"]:
        lines.append("  (none)")
    return [line.rstrip() for line in lines]
