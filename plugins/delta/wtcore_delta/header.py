"""The first tensor of a delta round: which base it applies to, and what each tensor is.

It travels on the data plane like any tensor (a flat ``uint8`` tensor of JSON under the
reserved name :data:`HEADER_NAME`), so every engine carries delta rounds unchanged and the
four vLLM calls keep their bodies. Tensors the header does not list are unchanged and do not
travel; ``patch`` tensors are :mod:`wtcore_delta.codec` blobs; ``full`` tensors are whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.meta import ALLOWED_DTYPE_NAMES

if TYPE_CHECKING:
    import torch

__all__ = ["HEADER_NAME", "KINDS", "MAX_HEADER_BYTES", "DeltaHeader"]

HEADER_NAME = "__wtcore_delta__"
KINDS = ("patch", "full")
#: A header larger than this is refused before it is parsed.
MAX_HEADER_BYTES = 64 << 20
_FORMAT = 1


@dataclass(frozen=True)
class DeltaHeader:
    """``base``: the version the patches were computed against; ``items``: name -> kind;
    ``specs``: name -> (dtype name, shape) of each patched tensor, checked by the receiver
    against the tensor it patches (a patch carries only the element width)."""

    base: str
    items: dict[str, str]
    specs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)

    def to_tensor(self) -> torch.Tensor:
        import torch

        wire = [
            [name, kind, *self.specs[name]] if kind == "patch" else [name, kind]
            for name, kind in self.items.items()
        ]
        raw = json.dumps(
            {"format": _FORMAT, "base": self.base, "items": wire}, separators=(",", ":")
        ).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> DeltaHeader:
        """Parse and check a received header; ``PayloadError`` naming the problem."""
        import torch

        def bad(why: str) -> PayloadError:
            return PayloadError(f"delta header {HEADER_NAME!r}: {why}; nothing was applied")

        if t.dtype != torch.uint8 or t.dim() != 1:
            raise bad(f"expected a flat uint8 tensor, got {t.dtype} of shape {list(t.shape)}")
        if t.numel() > MAX_HEADER_BYTES:
            raise bad(f"{t.numel()} bytes is over the {MAX_HEADER_BYTES}-byte limit")
        try:
            data = json.loads(bytes(t.cpu().numpy()).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise bad(f"not JSON ({e})") from None
        if not isinstance(data, dict) or set(data) != {"format", "base", "items"}:
            raise bad("expected an object with exactly format, base, items")
        if data["format"] != _FORMAT:
            raise bad(f"format {data['format']!r} is not {_FORMAT}")
        base, raw_items = data["base"], data["items"]
        if not isinstance(base, str) or not base:
            raise bad(f"base: expected a non-empty version string, got {base!r}")
        if not isinstance(raw_items, list):
            raise bad("items: expected a list of [name, kind] pairs")
        items: dict[str, str] = {}
        specs: dict[str, tuple[str, list[int]]] = {}
        for i, entry in enumerate(raw_items):
            if not _well_formed(entry):
                raise bad(
                    f'items[{i}]: expected [name, "full"] or [name, "patch", dtype name, '
                    f"shape], got {str(entry)[:200]}"
                )
            name = entry[0]
            if name in items or name == HEADER_NAME:
                raise bad(f"items[{i}]: name {name!r} is listed twice or reserved")
            items[name] = entry[1]
            if entry[1] == "patch":
                specs[name] = (entry[2], list(entry[3]))
        return cls(base, items, specs)


def _well_formed(entry: object) -> bool:
    if not isinstance(entry, list) or not entry or not isinstance(entry[0], str):
        return False
    if entry[1:] == ["full"]:
        return True
    return (
        len(entry) == 4
        and entry[1] == "patch"
        and entry[2] in ALLOWED_DTYPE_NAMES
        and isinstance(entry[3], list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[3])
    )
