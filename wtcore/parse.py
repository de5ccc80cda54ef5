"""Turn untrusted input into typed values, naming the field (or option) on every error.

One parser for every payload, config and command line, so that "missing", "unknown" and
"wrong type" read the same everywhere.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import weakref
from collections.abc import Mapping
from typing import Any, TypeVar

from wtcore.errors import PayloadError

__all__ = ["field_names", "parse_dataclass", "size_argument", "sizes_argument"]

T = TypeVar("T")

_NoneType = type(None)
_HINTS: weakref.WeakKeyDictionary[type, dict[str, Any]] = weakref.WeakKeyDictionary()  # read once


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _check(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _check(value, arg, path)
            except PayloadError:
                continue
        raise PayloadError(f"{path}: expected {_type_name(tp)}, got {_got(value)}")
    if tp is _NoneType:
        if value is None:
            return None
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif origin is list:
        if isinstance(value, list):
            (arg,) = typing.get_args(tp) or (Any,)
            if arg in (int, str) and all(type(v) is arg for v in value):  # fast: no paths
                return list(value)
            return [_check(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):  # str, bool, a class
        return value
    raise PayloadError(f"{path}: expected {_type_name(tp)}, got {_got(value)}")


def _got(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def parse_dataclass(cls: type[T], data: object, *, what: str) -> T:
    """Build ``cls`` from ``data``, rejecting unknown, missing and wrong-typed fields (a
    ``ValueError`` from ``__post_init__`` becomes a :class:`PayloadError` too)."""
    if not isinstance(data, Mapping):
        raise PayloadError(f"{what}: expected a JSON object, got {_got(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise PayloadError(
            f"{what}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"valid fields: {', '.join(fields)}"
        )
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PayloadError(
                    f"{what}.{name}: missing required field (expected {_type_name(hints[name])})"
                )
            continue
        kwargs[name] = _check(data[name], hints[name], f"{what}.{name}")
    try:
        return cls(**kwargs)
    except PayloadError:
        raise
    except (ValueError, TypeError) as e:
        raise PayloadError(f"{what}: {e}") from e


def size_argument(text: str) -> int:
    """An argparse ``type=`` for sizes (``4096``, ``64MiB``): a bad one is a usage error."""
    import argparse

    from wtcore.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sizes_argument(text: str) -> list[int]:
    """An argparse ``type=`` for a comma-separated list of sizes (``1MiB,16MiB``); may be empty."""
    return [size_argument(part) for part in text.split(",") if part.strip()]
