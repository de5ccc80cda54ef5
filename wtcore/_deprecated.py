"""The 0.1.0 module paths that moved in 0.2.0, forwarded with a warning until 0.3 (the new
module is imported only when a name is first asked for)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from wtcore.errors import PluginLoadError

__all__ = ["moved"]


def moved(
    old: str, new: str, install: str = "", renamed: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` forwarding ``old.NAME`` to ``new.NAME`` (``renamed``: old ->
    new) with a ``DeprecationWarning``; ``__all__`` too, so ``from old import *`` works."""
    renames = dict(renamed or {})

    def load() -> ModuleType:
        try:
            return importlib.import_module(new)
        except ImportError as e:
            hint = f" ({install})" if install else ""
            raise PluginLoadError(f"{old} moved to {new}, which is not installed{hint}") from e

    def __getattr__(name: str) -> Any:
        if name == "__all__":
            back = {v: k for k, v in renames.items()}
            return [back.get(n, n) for n in getattr(load(), "__all__", ())]
        target = renames.get(name, name)
        if name.startswith("__") or target not in getattr(load(), "__all__", ()):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {new}.{target}; the old path will be removed in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(load(), target)

    return __getattr__
