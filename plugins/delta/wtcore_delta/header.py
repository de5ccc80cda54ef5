"""The first tensor of a delta round: which base it applies to, and what each tensor is.

A flat ``uint8`` tensor of JSON under :data:`HEADER_NAME`, so every engine carries it. A base is
named by its version *and* the sending trainer's random lineage, since version names are the
user's and get reused; a full round's header (no base, no items) names only the lineage.
Unlisted tensors are unchanged; ``patch`` items are :mod:`wtcore_delta.codec` blobs.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError
from wtcore.meta import ALLOWED_DTYPE_NAMES

if TYPE_CHECKING:
    import torch

__all__ = ["HEADER_NAME", "KINDS", "LINEAGE_RE", "MAX_HEADER_BYTES", "DeltaHeader", "new_lineage"]

HEADER_NAME = "__wtcore_delta__"
KINDS = ("patch", "full")
#: A header larger than this is refused before it is parsed.
MAX_HEADER_BYTES = 64 << 20
#: Format 2 added the lineage (a format-1 header is refused: it cannot say whose base it is).
_FORMAT = 2
#: A trainer's lineage: 128 random bits, hex-encoded (always ``fullmatch``).
LINEAGE_RE = re.compile(r"[0-9a-f]{32}")


def new_lineage() -> str:
    return secrets.token_hex(16)


@dataclass(frozen=True)
class DeltaHeader:
    """``base``: the patches' version (``None``: a full round); ``items``: name -> kind;
    ``specs``: name -> (dtype name, shape) of each patch, checked by the receiver (a patch
    carries only the element width)."""

    base: str | None
    items: dict[str, str]
    specs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    lineage: str = ""

    @property
    def marks_full(self) -> bool:
        """A full round's header: no patches, it only names the trainer whose weights follow."""
        return self.base is None

    def to_tensor(self) -> torch.Tensor:
        import torch

        wire = [
            [name, kind, *self.specs[name]] if kind == "patch" else [name, kind]
            for name, kind in self.items.items()
        ]
        raw = json.dumps(
            {"format": _FORMAT, "lineage": self.lineage, "base": self.base, "items": wire},
            separators=(",", ":"),
        ).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> DeltaHeader:
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
        if not isinstance(data, dict) or set(data) != {"format", "lineage", "base", "items"}:
            raise bad("expected an object with exactly format, lineage, base, items")
        if data["format"] != _FORMAT:
            raise bad(f"format {data['format']!r} is not {_FORMAT} (upgrade wtcore-delta)")
        lineage, base, raw_items = data["lineage"], data["base"], data["items"]
        if not isinstance(lineage, str) or not LINEAGE_RE.fullmatch(lineage):
            raise bad(f"lineage: expected {LINEAGE_RE.pattern}, got {str(lineage)[:40]!r}")
        if base is not None and (not isinstance(base, str) or not base):
            raise bad(f"base: expected a non-empty version string or null, got {base!r}")
        if not isinstance(raw_items, list):
            raise bad("items: expected a list of [name, kind] pairs")
        if base is None and raw_items:
            raise bad("items: a full round's header (base null) lists no items")
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
        return cls(base, items, specs, lineage)


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
