"""Every error the core raises to users is a ``WtcoreError`` that is also the natural builtin.

Two halves: behaviour (each condition that used to raise a bare builtin now raises one of the
family, naming the field; a missing config file and an unknown stats phase, a
``FileNotFoundError`` and a ``KeyError`` in 0.1.0, are a ``PayloadError``, a ``ValueError``),
and a source walk that fails on any new ``raise ValueError(...)``-style statement in
``wtcore/`` or the plugins, so the family stays the only thing users meet
(docs/architecture.md, "Errors").
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from wtcore.errors import PayloadError, PluginLoadError, WtcoreError, http_status

ROOT = Path(__file__).resolve().parents[2]

# --- behaviour ---------------------------------------------------------------------------


def test_missing_config_file_names_the_path(tmp_path: Path) -> None:
    from wtcore.config import load_config

    missing = tmp_path / "nope.toml"
    with pytest.raises(PayloadError, match=r"config: .*nope\.toml: no such file") as info:
        load_config(missing)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert http_status(info.value) == 400


def test_unknown_stats_phase_is_a_payload_error_with_a_readable_message() -> None:
    from wtcore.stats import TransferStats

    with pytest.raises(PayloadError) as info, TransferStats().phase("warp"):
        pass
    assert str(info.value).startswith("unknown phase 'warp'; phases are ")


def test_bad_size_is_a_payload_error() -> None:
    from wtcore.units import format_size, parse_size

    with pytest.raises(PayloadError, match="expected a size such as"):
        parse_size("12 parsecs")
    assert [format_size(n) for n in (5, 1536, 3 << 20, 5 << 30)] == [
        "5 B",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]


def test_bucket_errors_are_payload_errors() -> None:
    from wtcore.buckets import pack_bucket, plan_buckets, unpack_bucket
    from wtcore.meta import ParamMeta

    meta = ParamMeta.of("w", torch.zeros(4))
    with pytest.raises(PayloadError, match="buffer_size_bytes must be positive"):
        plan_buckets([meta], 0)
    (bucket,) = plan_buckets([meta], 1024)
    small = torch.empty(2, dtype=torch.uint8)
    with pytest.raises(PayloadError, match="too small"):
        pack_bucket(bucket, [torch.zeros(4)], small)
    with pytest.raises(PayloadError, match="holds 1 tensors, got 0"):
        pack_bucket(bucket, [], torch.empty(64, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="too small"):
        list(unpack_bucket(bucket, small))


def test_staging_a_sink_without_named_tensors_is_a_payload_error() -> None:
    from wtcore.staging import StagingSink

    class WriteOnly:
        def load_weights(self, weights: object) -> None:
            pass

    with pytest.raises(PayloadError, match="WriteOnly has none"):
        StagingSink(WriteOnly())  # type: ignore[arg-type]


def test_registering_a_hook_plugin_twice_is_a_conflict() -> None:
    from wtcore.hooks import register_hooks, unregister_hooks

    class Plugin:
        pass

    plugin = Plugin()
    name = register_hooks(plugin, name="test-error-family")
    try:
        with pytest.raises(PluginLoadError, match="already registered") as info:
            register_hooks(plugin, name="test-error-family")
        assert info.value.reason == "conflict"
    finally:
        unregister_hooks(name=name)


# --- the source walk ---------------------------------------------------------------------

#: Builtin exception classes raised by name (every subclass of BaseException in builtins).
_BUILTIN_ERRORS = frozenset(
    n
    for n, v in vars(builtins).items()
    if isinstance(v, type) and issubclass(v, BaseException) and not n.startswith("_")
)

#: Always allowed, by rule: (builtin, reason).
_ALWAYS = {
    "NotImplementedError": "an abstract hook a subclass must override: a bug in the subclass",
    "StopIteration": "the iterator protocol",
    "KeyboardInterrupt": "re-raising the user's interrupt",
    "SystemExit": "the CLI's exit status",
}

#: Allowed where they are, with a reason: (file, enclosing function, builtin) -> reason.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "wtcore/testing/contract.py",
        "SwitchableSink.load_weights",
        "RuntimeError",
    ): "deliberately foreign: the contract checks that engines survive a sink raising a "
    "non-wtcore error",
}

#: Files owned by other work in progress; each entry must go (the integrator fixes them). The
#: test fails on an entry that no longer matches, so this list only shrinks.
PENDING: frozenset[tuple[str, str, str]] = frozenset()


def _raises(path: Path) -> Iterator[tuple[str, str, int]]:
    """``(enclosing function qualname, builtin name, line)`` of each ``raise <builtin>``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    stack: list[str] = []

    def visit(node: ast.AST) -> Iterator[tuple[str, str, int]]:
        scoped = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if scoped:
            stack.append(node.name)  # type: ignore[attr-defined]
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in _BUILTIN_ERRORS:
                yield ".".join(stack), exc.id, node.lineno
        for child in ast.iter_child_nodes(node):
            yield from visit(child)
        if scoped:
            stack.pop()

    yield from visit(tree)


def _sources() -> list[Path]:
    files = sorted((ROOT / "wtcore").rglob("*.py")) + sorted((ROOT / "wtcore_kit").rglob("*.py"))
    files += sorted(p for p in (ROOT / "plugins").rglob("*.py") if "/wtcore_" in p.as_posix())
    return files


def _violations() -> tuple[list[str], set[tuple[str, str, str]]]:
    found: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for func, name, line in _raises(path):
            key = (rel, func, name)
            seen.add(key)
            if name in _ALWAYS or key in ALLOWED or key in PENDING:
                continue
            if name == "AttributeError" and func.rsplit(".", 1)[-1] == "__getattr__":
                continue  # the module/attribute protocol: hasattr() relies on it
            found.append(f"{rel}:{line}: raise {name} in {func or '<module>'}")
    return found, seen


def test_no_bare_builtin_is_raised_to_users() -> None:
    found, _ = _violations()
    assert not found, (
        "raise a wtcore.errors class (it keeps the builtin base) instead of a bare builtin, "
        "or allow-list it with a reason:\n" + "\n".join(found)
    )


def test_allow_lists_hold_no_stale_entries() -> None:
    _, seen = _violations()
    stale = sorted((set(ALLOWED) | PENDING) - seen)
    assert not stale, f"these entries no longer match a raise; remove them: {stale}"


def test_the_walk_finds_a_bare_raise(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "class C:\n"
        "    def f(self):\n"
        "        raise ValueError('x')\n"
        "    def __getattr__(self, name):\n"
        "        raise AttributeError(name)\n"
        "def g():\n"
        "    raise TypeError\n"
    )
    assert list(_raises(bad)) == [
        ("C.f", "ValueError", 3),
        ("C.__getattr__", "AttributeError", 5),
        ("g", "TypeError", 7),
    ]


def test_every_family_member_is_a_wtcore_error() -> None:
    import wtcore.errors as errors

    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, WtcoreError), name
