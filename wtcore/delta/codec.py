"""The patch codec: what changed in one tensor, as a self-describing ``uint8`` blob.

A patch holds the positions and the new raw bits of the elements that differ from the base.
Elements are compared and copied as integers of the element's width (``bits``), never as
floats, so NaN payloads, ``-0.0`` and subnormals travel exactly.

Three position encodings, chosen per tensor by size (:func:`encode`):

* ``INDEX``: a sorted list of flat indices (int32, or int64 for tensors of 2**31 elements or
  more); cheapest when few scattered elements changed;
* ``MASK``: one bit per element (little-endian bit order inside each byte); cheapest when many
  changed;
* ``RUNS``: ``(start, length)`` pairs; cheapest when the changes are contiguous.

Layout (little-endian; :data:`HEADER_BYTES` bytes of header, then the body)::

    magic "WTDP" | format u8 | encoding u8 | itemsize u8 | 0 u8 |
    numel u64 | count u64 | runs u64 | positions ... | values (count * itemsize bytes)

A patch arrives from the network, so :func:`decode` trusts nothing: magic, format,
encoding, item size, element count, exact length, index order and bounds, mask padding and
popcount, run bounds and overlap are all checked before it returns positions that
:func:`apply_patch` may write.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENCODINGS",
    "HEADER_BYTES",
    "Decoded",
    "Encoded",
    "apply_patch",
    "bits",
    "decode",
    "encode",
    "patch_sizes",
]

MAGIC = b"WTDP"
FORMAT = 1
INDEX, MASK, RUNS = 1, 2, 3
ENCODINGS: dict[int, str] = {INDEX: "index", MASK: "mask", RUNS: "runs"}
_HEADER = struct.Struct("<4sBBBBQQQ")
HEADER_BYTES = _HEADER.size  # 32
_INT32_LIMIT = 1 << 31


def _int_dtype(itemsize: int) -> torch.dtype:
    import torch

    dtypes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if itemsize not in dtypes:
        raise PayloadError(f"no integer view for elements of {itemsize} bytes")
    return dtypes[itemsize]


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a flat integer tensor of the same element width: exact compares."""
    import torch

    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_int_dtype(flat.element_size()))


def _pos_width(numel: int) -> int:
    return 4 if numel < _INT32_LIMIT else 8


def patch_sizes(numel: int, itemsize: int, count: int, runs: int) -> dict[int, int]:
    """Bytes of each encoding for ``count`` changed elements in ``runs`` runs."""
    w = _pos_width(numel)
    values = count * itemsize
    return {
        INDEX: HEADER_BYTES + count * w + values,
        MASK: HEADER_BYTES + (numel + 7) // 8 + values,
        RUNS: HEADER_BYTES + runs * 2 * w + values,
    }


@dataclass(frozen=True)
class Encoded:
    """One tensor's outcome: ``kind`` is ``"same"``, ``"patch"`` (``blob`` set) or ``"full"``."""

    kind: str
    count: int
    blob: torch.Tensor | None = None
    encoding: int = 0


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def encode(new: torch.Tensor, base: torch.Tensor) -> tuple[Encoded, torch.Tensor | None]:
    """Compare ``new`` with ``base`` (same dtype, shape, device); pick the smallest form.

    Returns the outcome and, for a patch, the changed flat indices (int64), so the caller can
    bring its base up to date without a second comparison.
    """
    import torch

    nb, bb = bits(new), bits(base)
    numel, itemsize = nb.numel(), nb.element_size()
    mask = nb != bb
    count = int(mask.sum())
    if count == 0:
        return Encoded("same", 0), None
    full = numel * itemsize
    if min(patch_sizes(numel, itemsize, count, 0).values()) >= full:
        return Encoded("full", count), None  # runs cost at least one pair too
    starts = mask.clone()
    starts[1:] &= ~mask[:-1]
    runs = int(starts.sum())
    sizes = patch_sizes(numel, itemsize, count, runs)
    encoding = min(sizes, key=lambda k: sizes[k])
    if sizes[encoding] >= full:
        return Encoded("full", count), None
    idx = mask.nonzero().reshape(-1)
    values = nb[idx]
    pos_dtype = torch.int32 if _pos_width(numel) == 4 else torch.int64
    if encoding == INDEX:
        positions = _as_bytes(idx.to(pos_dtype))
    elif encoding == MASK:
        pad = (-numel) % 8
        padded = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=nb.device)
        positions = (padded.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
    else:
        run_starts = starts.nonzero().reshape(-1)
        ends = mask.clone()
        ends[:-1] &= ~mask[1:]
        lengths = ends.nonzero().reshape(-1) - run_starts + 1
        positions = _as_bytes(torch.stack([run_starts, lengths], 1).to(pos_dtype))
    header = _HEADER.pack(
        MAGIC, FORMAT, encoding, itemsize, 0, numel, count, runs if encoding == RUNS else 0
    )
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(nb.device)
    blob = torch.cat([head, positions.reshape(-1), _as_bytes(values)])
    return Encoded("patch", count, blob, encoding), idx


@dataclass(frozen=True)
class Decoded:
    """A checked patch: flat int64 ``positions`` (sorted, in bounds) and raw ``values``."""

    encoding: int
    positions: torch.Tensor
    values: torch.Tensor


def decode(blob: torch.Tensor, target: torch.Tensor, *, name: str) -> Decoded:
    """Parse and check ``blob`` against the tensor it will patch; ``PayloadError`` naming
    ``name`` and the problem on anything malformed (nothing is written here)."""
    import torch

    def bad(why: str) -> PayloadError:
        return PayloadError(f"delta patch for {name!r}: {why}; nothing of it was applied")

    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise bad(f"expected a flat uint8 blob, got {blob.dtype} of shape {list(blob.shape)}")
    if blob.numel() < HEADER_BYTES:
        raise bad(f"{blob.numel()} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, fmt, encoding, itemsize, zero, numel, count, runs = _HEADER.unpack(
        bytes(blob[:HEADER_BYTES].cpu().numpy())
    )
    tb = bits(target)
    if magic != MAGIC or fmt != FORMAT or zero != 0:
        raise bad(f"not a format-{FORMAT} patch (magic {magic!r}, format {fmt})")
    if encoding not in ENCODINGS:
        raise bad(f"unknown encoding {encoding}")
    if itemsize != tb.element_size():
        raise bad(f"item size {itemsize} does not match the tensor's {tb.element_size()}")
    if numel != tb.numel():
        raise bad(f"numel {numel} does not match the tensor's {tb.numel()}")
    if not 0 < count <= numel or runs > count or (encoding == RUNS) != (runs > 0):
        raise bad(f"count {count} / runs {runs} out of range for {numel} elements")
    expected = patch_sizes(numel, itemsize, count, runs)[encoding]
    if blob.numel() != expected:
        raise bad(f"{blob.numel()} bytes, expected {expected} for {count} changed elements")
    w = _pos_width(numel)
    pos_dtype = torch.int32 if w == 4 else torch.int64
    body = blob[HEADER_BYTES:].to(tb.device)
    values = _view(body[expected - HEADER_BYTES - count * itemsize :], tb.dtype)
    if encoding == INDEX:
        positions = _view(body[: count * w], pos_dtype).to(torch.int64)
        _check_sorted(positions, numel, bad)
    elif encoding == MASK:
        packed = body[: (numel + 7) // 8]
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        flags = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1).bool()
        if bool(flags[numel:].any()):
            raise bad("mask padding bits are set")
        positions = flags[:numel].nonzero().reshape(-1)
        if positions.numel() != count:
            raise bad(f"mask marks {positions.numel()} elements, header says {count}")
    else:
        pairs = _view(body[: runs * 2 * w], pos_dtype).to(torch.int64).view(runs, 2)
        run_starts, lengths = pairs[:, 0], pairs[:, 1]
        if bool((lengths < 1).any()) or bool((run_starts < 0).any()):
            raise bad("a run has a negative start or a length below 1")
        ends = run_starts + lengths
        if bool((ends > numel).any()):
            raise bad(f"a run ends past the tensor's {numel} elements")
        if runs > 1 and bool((run_starts[1:] < ends[:-1]).any()):
            raise bad("runs overlap or are not sorted")
        if int(lengths.sum()) != count:
            raise bad(f"runs cover {int(lengths.sum())} elements, header says {count}")
        before = torch.cumsum(lengths, 0) - lengths  # elements in earlier runs
        positions = torch.repeat_interleave(run_starts - before, lengths) + torch.arange(
            count, device=body.device
        )
    return Decoded(encoding, positions, values)


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` bytes as ``dtype``, copied first when they are not aligned for it."""
    size = raw.new_empty(0, dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype)


def _check_sorted(positions: torch.Tensor, numel: int, bad: Callable[[str], PayloadError]) -> None:
    if bool((positions < 0).any()) or bool((positions >= numel).any()):
        raise bad(f"an index is outside [0, {numel})")
    if positions.numel() > 1 and bool((positions[1:] <= positions[:-1]).any()):
        raise bad("indices are not strictly increasing")


def apply_patch(target: torch.Tensor, patch: Decoded) -> None:
    """Write the patch's values into ``target`` (contiguous) at its positions, bit-exact."""
    if not target.is_contiguous():
        raise PayloadError("apply_patch: the target tensor must be contiguous")
    tb = bits(target)
    tb[patch.positions.to(tb.device)] = patch.values.to(tb.device)
