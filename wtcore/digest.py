"""Per-tensor digests, used for checksums and end-to-end verification.

BLAKE2b over the dtype, the shape and the raw bytes: hashlib releases the GIL on large
buffers, needs no extra dependency, and a digest of what the trainer sent can be compared with
a digest of what a receiver holds, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from wtcore.meta import dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["digest_named", "tensor_digest"]


def tensor_digest(t: torch.Tensor) -> str:
    """Hex BLAKE2b-128 digest of ``t``'s dtype, shape and bytes."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype_name(t.dtype)}{list(t.shape)}".encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if flat.numel():
        h.update(memoryview(flat.numpy()))  # type: ignore[arg-type]
    return h.hexdigest()


def digest_named(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: digest}`` for each pair."""
    return {name: tensor_digest(t) for name, t in items}
