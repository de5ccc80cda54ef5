"""Who imports whom, over the core and every first-party plugin: the graph the import and
layering tests check.

Read from the source with :mod:`ast`, so nothing is imported and optional dependencies do not
matter. Every import statement counts, wherever it is: inside functions (a lazy import is still
a dependency: it only moves the failure to run time), under ``if TYPE_CHECKING:`` (the types are
still a design dependency, and a circle there is one refactor away from an import loop) and
under ``if __name__ == "__main__":`` (the program is still part of the module's design). A
module that forwards lazily by string (``wtcore._deprecated``) has no edge: that is the point of
it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PACKAGES", "ROOT", "cycles", "graph", "modules"]

ROOT = Path(__file__).resolve().parents[2]
# every plugin under plugins/ is seen, a new one included
PACKAGES = {"wtcore": ROOT / "wtcore", "wtcore_kit": ROOT / "wtcore_kit"} | {
    d.name: d for d in sorted(ROOT.glob("plugins/*/wtcore_*")) if (d / "__init__.py").exists()
}


def _module_name(package: str, base: Path, path: Path) -> str:
    parts = [package, *path.relative_to(base).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every first-party module by dotted name."""
    return {
        _module_name(pkg, base, path): path
        for pkg, base in PACKAGES.items()
        for path in sorted(base.rglob("*.py"))
    }


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that ``module`` imports (``from pkg import sub`` resolves to ``sub``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            # the longest known prefix: `wtcore_bench.api.ModelSpec` -> `wtcore_bench.api`
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    """``{module: the first-party modules it imports}``."""
    mods = modules()
    known = set(mods)
    return {m: _imported(m, p, known) for m, p in mods.items()}


def _is_parent_package(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan).

    Importing a submodule always imports its parent packages first, so an edge from a package
    ``__init__`` down to its own submodule (a re-export) is how packages work, not a cycle.
    """
    edges = {m: {d for d in ds if not _is_parent_package(m, d)} for m, ds in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out
