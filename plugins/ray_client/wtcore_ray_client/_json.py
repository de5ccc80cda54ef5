"""Keep the Ray control plane to the same plain-JSON payloads as HTTP: what works over Ray then
works over HTTP, and no receiver unpickles a live object it did not ask for."""

from __future__ import annotations

from typing import Any

from wtcore.errors import PayloadError

__all__ = ["check_json_safe"]

_SCALARS = (str, int, float, bool, type(None))


def check_json_safe(value: Any, what: str) -> None:
    """Raise :class:`PayloadError` naming the first value JSON cannot carry (walked without
    serializing, so a large base64 string costs nothing; tuples pass, as lists)."""
    stack: list[tuple[str, Any]] = [(what, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _SCALARS):
            continue
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise PayloadError(
                        f"{path}: keys must be strings (JSON), got {type(k).__name__} {k!r}"
                    )
                stack.append((f"{path}[{k!r}]", item))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
        else:
            raise PayloadError(
                f"{path}: expected a JSON value (dict, list, str, int, float, bool, None), "
                f"got {type(v).__module__}.{type(v).__qualname__}; the Ray control plane "
                "carries the same plain-JSON payloads as HTTP"
            )
