"""Static checks of who imports whom, over the core and every first-party plugin.

Read from the source with :mod:`ast`, so nothing is imported and optional dependencies do not
matter. Imports inside functions count like module-level ones (a lazy import is still a
dependency: it only moves the failure to run time). Two kinds do not count: imports under
``if TYPE_CHECKING:`` (they never run) and under ``if __name__ == "__main__":`` (they run only
when the file is the program, as a module named ``__main__``, which nothing imports back).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"wtcore": ROOT / "wtcore"} | {
    d.name: d for d in sorted(ROOT.glob("plugins/*/wtcore_*")) if (d / "__init__.py").exists()
}


def _module_name(package: str, base: Path, path: Path) -> str:
    parts = [package, *path.relative_to(base).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(pkg, base, path): path
        for pkg, base in PACKAGES.items()
        for path in sorted(base.rglob("*.py"))
    }


def _never_imported(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``__name__ == "__main__"``: a branch no importer ever runs."""
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
        return True
    if isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return True
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement an importer can run (see the module docstring for the two skips)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _never_imported(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that ``module`` imports (``from pkg import sub`` resolves to ``sub``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
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


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imported(m, p, known) for m, p in mods.items()}


def _is_parent_package(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_the_walk_sees_every_package_and_lazy_imports() -> None:
    graph = _graph()
    assert {"wtcore", "wtcore_nccl", "wtcore_ipc", "wtcore_http_client"} <= set(graph)
    # a function-level import counts: the bench's command imports the runner lazily
    assert "wtcore_bench" in graph["wtcore_bench.commands"]


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles (module-level or inside functions):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_production_code_never_imports_wtcore_testing() -> None:
    """Engines, clients and the protocol never import the tests' tools; the bench (tooling
    itself) may."""
    graph = _graph()
    offenders = sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if not (m.startswith(("wtcore.testing.", "wtcore_bench")) or m == "wtcore.testing")
        for d in deps
        if d == "wtcore.testing" or d.startswith("wtcore.testing.")
    )
    assert offenders == []
