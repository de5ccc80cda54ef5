"""What one parameter looks like on the wire, and the dtype allow-list.

The only translation between ``torch.dtype`` and its wire name: a payload must never make a
receiver look up an arbitrary attribute of ``torch``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALLOWED_DTYPE_NAMES",
    "MAX_NUMEL",
    "ParamMeta",
    "dtype_from_name",
    "dtype_name",
    "materialize_full_tensor",
    "metas_from_wire",
    "metas_to_wire",
]

#: Wire names of every dtype a payload may carry.
ALLOWED_DTYPE_NAMES: tuple[str, ...] = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
)  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``: ``str(dtype).split(".")[-1]`` (docs/protocol.md, "Payloads")."""
    return str(dtype).split(".")[-1]


def dtype_from_name(name: object, *, field: str = "dtype_names") -> torch.dtype:
    """Resolve a wire dtype name, accepting only names on the allow-list."""
    import torch

    if not isinstance(name, str) or name not in ALLOWED_DTYPE_NAMES:
        raise PayloadError(
            f"{field}: expected one of {', '.join(ALLOWED_DTYPE_NAMES)}, got {name!r}"
        )
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):  # pragma: no cover - old torch without float8
        raise PayloadError(f"{field}: dtype {name!r} is not supported by torch {torch.__version__}")
    return dtype


#: Most elements one tensor may hold on the wire (256 Ti), so no size computed from a hostile
#: shape overflows anything downstream.
MAX_NUMEL = 1 << 48


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as it travels: its name, wire dtype and full (unsharded) shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> ParamMeta:
        return cls(name, tensor.dtype, tuple(int(d) for d in tensor.shape))


def metas_to_wire(metas: Sequence[ParamMeta]) -> dict[str, Any]:
    """The JSON-safe ``names``/``dtype_names``/``shapes`` triple (docs/protocol.md, "Payloads")."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_from_wire(names: object, dtype_names: object, shapes: object) -> list[ParamMeta]:
    """Validate and decode the wire triple. Errors name the field and the bad index."""
    for field, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(value, list):
            raise PayloadError(f"{field}: expected a list, got {type(value).__name__}")
    assert isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise PayloadError(
            "names, dtype_names and shapes must have the same length, got "
            f"{len(names)}, {len(dtype_names)} and {len(shapes)}"
        )
    metas: list[ParamMeta] = []
    seen: set[str] = set()
    for i, (name, dname, shape) in enumerate(zip(names, dtype_names, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise PayloadError(f"names[{i}]: expected a non-empty string, got {name!r}")
        if name in seen:
            raise PayloadError(f"names[{i}]: duplicate name {name!r}")
        seen.add(name)
        dtype = dtype_from_name(dname, field=f"dtype_names[{i}]")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise PayloadError(
                f"shapes[{i}]: expected a list of non-negative integers, got {shape!r}"
            )
        meta = ParamMeta(name, dtype, tuple(shape))
        if meta.numel > MAX_NUMEL:
            raise PayloadError(
                f"shapes[{i}]: {shape!r} holds {meta.numel} elements, over the limit of 2**48"
            )
        metas.append(meta)
    return metas


def materialize_full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind ``t``: a DTensor's ``full_tensor()`` (a collective every rank
    calls in the same order), else ``t``."""
    full = getattr(t, "full_tensor", None)
    if callable(full):
        return full()  # type: ignore[no-any-return]
    return t
