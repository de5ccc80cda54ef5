"""Static checks of who imports whom, over the core and every first-party plugin.

The graph (:mod:`graph`, next to this file) counts every import statement: inside functions,
under ``if TYPE_CHECKING:`` and under ``if __name__ == "__main__":``, since a circle hidden in
any of them is still a circle in the design. The layers are checked in ``test_layering.py``.
"""

from __future__ import annotations

from .graph import cycles, graph

# Circles being taken apart elsewhere, each listed exactly; a new one fails the test.
# Circles allowed by name while they are being taken apart, each with why. None today: the
# last one (the base trainer and the delta trainer) went when delta rounds became a round
# policy the send template is given (test_layering puts it back to check it is caught).
KNOWN_CIRCLES: list[list[str]] = []


def test_the_walk_sees_every_package_and_lazy_typing_and_main_imports() -> None:
    g = graph()
    assert {"wtcore", "wtcore_nccl", "wtcore_ipc", "wtcore_http_client"} <= set(g)
    # a function-level import counts: the bench's command imports the runner lazily
    assert "wtcore_bench" in g["wtcore_bench.commands"]
    # a `__main__` block counts: `python -m wtcore_http_client.commands` runs its own main
    assert "wtcore_http_client.server" in g["wtcore_http_client.commands"]


def test_no_import_cycles() -> None:
    found = [c for c in cycles(graph()) if c not in KNOWN_CIRCLES]
    assert found == [], "import cycles (any import statement, see graph.py):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_every_known_circle_is_still_there() -> None:
    """An entry outliving its circle would hide the circle coming back: delete it instead."""
    found = cycles(graph())
    assert [c for c in KNOWN_CIRCLES if c not in found] == []


def test_production_code_never_imports_wtcore_testing() -> None:
    """Engines, clients and the protocol never import the tests' tools; the bench (tooling
    itself) may."""
    g = graph()
    offenders = sorted(
        f"{m} imports {d}"
        for m, deps in g.items()
        if not (m.startswith(("wtcore.testing.", "wtcore_bench")) or m == "wtcore.testing")
        for d in deps
        if d == "wtcore.testing" or d.startswith("wtcore.testing.")
    )
    assert offenders == []
