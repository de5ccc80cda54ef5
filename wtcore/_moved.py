"""Old import paths of modules that moved out of the core, kept for one release with a warning.

The core is the protocol; its tooling moved to ``wtcore.testing`` and to the ``wtcore-bench``
distribution (CHANGELOG, 0.2.0). A module left at the old path sets ``__getattr__ =
moved(__name__, "new.module")``: each name is imported from the new place when first asked for,
so the core never imports the tooling itself. A module that was renamed, names and all, passes
``renamed`` (old name -> new name).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

from wtcore.errors import PluginLoadError

__all__ = ["moved"]


def moved(
    old: str, new: str, install: str = "", renamed: dict[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that forwards ``old.NAME`` to ``new.NAME`` with a warning."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = (renamed or {}).get(name, name)
        try:
            module = importlib.import_module(new)
        except ImportError as e:
            hint = f" ({install})" if install else ""
            raise PluginLoadError(f"{old} moved to {new}, which is not installed{hint}") from e
        if target not in getattr(module, "__all__", ()):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {new}.{target}; the old path will be removed in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, target)

    return __getattr__
