"""Old import paths of modules that moved, kept for one release with a warning.

Why one table (:data:`MOVED`) and not a file per old path: the old paths are one list to read
and to drop in 0.3, and ``wtcore/`` holds nothing but the protocol. :class:`_OldPaths`, last on
``sys.meta_path`` (a real module always wins), makes each old path a module that imports its
names from the new place when first asked for, with a warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from wtcore.errors import PluginLoadError

__all__ = ["MOVED", "install", "moved"]

_BENCH, _DELTA = "pip install wtcore-bench", "pip install wtcore-delta"
_LOCAL = ("InitInfo", "TrainerEngine", "TrainerInitInfo", "UpdateInfo", "WorkerEngine")
_DELTA_MODULES = ("codec", "header", "receiver", "trainer")
_KIT = ("bucketed", "fanout", "concurrency", "pairs", "inline", "inproc", "synthetic")
#: Each old path: (its new module, the install line if that is another distribution, and
#: ``{old name: new name}`` where names were renamed too).
MOVED: dict[str, tuple[str, str, dict[str, str]]] = {
    "wtcore.bench": ("wtcore_bench", _BENCH, {}),
    "wtcore.netns": ("wtcore_bench.netns", _BENCH, {}),
    "wtcore.testing.cluster": ("wtcore_bench.netns", _BENCH, {}),
    "wtcore.procs": ("wtcore.testing.procs", "", {}),
    "wtcore.net": ("wtcore.testing.net", "", {}),
    "wtcore._parse": ("wtcore.parse", "", {}),
    "wtcore.guards": ("wtcore.finite", "", {}),
    "wtcore.delta": ("wtcore_delta", _DELTA, {}),
    **{f"wtcore.delta.{m}": (f"wtcore_delta.{m}", _DELTA, {}) for m in _DELTA_MODULES},
    "wtcore.delta.realistic": ("wtcore.testing.realistic", "", {}),
    "wtcore.kit": ("wtcore_kit.bucketed", "", {}),
    "wtcore.local": ("wtcore_kit.inline", "", {f"Local{p}": f"Inline{p}" for p in _LOCAL}),
    **{f"wtcore.{m}": (f"wtcore_kit.{m}", "", {}) for m in _KIT},
}


def moved(
    old: str, new: str, install: str = "", renamed: dict[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that forwards ``old.NAME`` to ``new.NAME`` with a warning
    (and ``old.__all__`` to the new module's, so ``from old import *`` forwards too)."""

    def load() -> ModuleType:
        try:
            return importlib.import_module(new)
        except ImportError as e:
            hint = f" ({install})" if install else ""
            raise PluginLoadError(f"{old} moved to {new}, which is not installed{hint}") from e

    def __getattr__(name: str) -> Any:
        if name == "__all__":
            back = {v: k for k, v in (renamed or {}).items()}
            return [back.get(n, n) for n in getattr(load(), "__all__", ())]
        if name.startswith("__"):
            raise AttributeError(name)
        target = (renamed or {}).get(name, name)
        module = load()
        if target not in getattr(module, "__all__", ()):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {new}.{target}; the old path will be removed in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, target)

    return __getattr__


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` (a package where one old path is below another)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        package = any(m.startswith(fullname + ".") for m in MOVED)
        return importlib.util.spec_from_loader(fullname, self, is_package=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new, install_line, renamed = MOVED[module.__name__]
        module.__getattr__ = moved(module.__name__, new, install_line, renamed)  # type: ignore[method-assign]


def install() -> None:
    """Put the old paths' finder last on ``sys.meta_path`` (once; ``import wtcore`` calls it)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
