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


def encode(new: torch.Tensor, base: torch.Tensor) -> tuple[Encoded, torch.Tensor | None]:
    """Compare ``new`` with ``base`` (same dtype, shape, device); pick the smallest form.

    Returns the outcome and, for a patch, the changed flat indices (int64, on ``new``'s
    device), so the caller can bring its base up to date without a second comparison. The
    positions are worked out with numpy on the CPU (an accelerator only compares and gathers):
    its bit operations are many times faster than torch's on CPU tensors.
    """
    import numpy as np
    import torch

    nb, bb = bits(new), bits(base)
    numel, itemsize = nb.numel(), nb.element_size()
    on_cpu = nb.device.type == "cpu" and bb.device.type == "cpu"
    mask = nb.numpy() != bb.numpy() if on_cpu else (nb != bb).cpu().numpy()
    count = int(np.count_nonzero(mask))
    if count == 0:
        return Encoded("same", 0), None
    full = numel * itemsize
    if min(patch_sizes(numel, itemsize, count, 0).values()) >= full:
        return Encoded("full", count), None  # runs cost at least one pair too
    runs = int(np.count_nonzero(mask[1:] & ~mask[:-1])) + int(mask[0])
    sizes = patch_sizes(numel, itemsize, count, runs)
    encoding = min(sizes, key=lambda k: sizes[k])
    if sizes[encoding] >= full:
        return Encoded("full", count), None
    idx_np = np.flatnonzero(mask)
    idx = torch.from_numpy(idx_np).to(nb.device)
    values = (nb.numpy()[idx_np] if on_cpu else nb[idx].cpu().numpy()).view(np.uint8)
    pos_dtype = np.int32 if _pos_width(numel) == 4 else np.int64
    if encoding == INDEX:
        positions = idx_np.astype(pos_dtype).view(np.uint8)
    elif encoding == MASK:
        positions = np.packbits(mask, bitorder="little")
    else:
        edges = np.flatnonzero(np.diff(mask, prepend=False, append=False))
        run_starts, run_ends = edges[0::2], edges[1::2]
        pairs = np.stack([run_starts, run_ends - run_starts], 1)
        positions = pairs.astype(pos_dtype).reshape(-1).view(np.uint8)
    header = _HEADER.pack(
        MAGIC, FORMAT, encoding, itemsize, 0, numel, count, runs if encoding == RUNS else 0
    )
    raw = np.concatenate([np.frombuffer(header, dtype=np.uint8), positions, values])
    return Encoded("patch", count, torch.from_numpy(raw), encoding), idx


@dataclass(frozen=True)
class Decoded:
    """A checked patch: flat int64 ``positions`` (sorted, in bounds) and raw ``values``."""

    encoding: int
    positions: torch.Tensor
    values: torch.Tensor


def decode(blob: torch.Tensor, target: torch.Tensor, *, name: str) -> Decoded:
    """Parse and check ``blob`` against the tensor it will patch; ``PayloadError`` naming
    ``name`` and the problem on anything malformed (nothing is written here)."""
    import numpy as np
    import torch

    def bad(why: str) -> PayloadError:
        return PayloadError(f"delta patch for {name!r}: {why}; nothing of it was applied")

    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise bad(f"expected a flat uint8 blob, got {blob.dtype} of shape {list(blob.shape)}")
    if blob.numel() < HEADER_BYTES:
        raise bad(f"{blob.numel()} bytes is shorter than the {HEADER_BYTES}-byte header")
    raw = blob.detach().cpu().numpy()
    magic, fmt, encoding, itemsize, zero, numel, count, runs = _HEADER.unpack(
        raw[:HEADER_BYTES].tobytes()
    )
    width = 1 if target.dtype == torch.bool else target.element_size()
    if magic != MAGIC or fmt != FORMAT or zero != 0:
        raise bad(f"not a format-{FORMAT} patch (magic {magic!r}, format {fmt})")
    if encoding not in ENCODINGS:
        raise bad(f"unknown encoding {encoding}")
    if itemsize != width:
        raise bad(f"item size {itemsize} does not match the tensor's {width}")
    if numel != target.numel():
        raise bad(f"numel {numel} does not match the tensor's {target.numel()}")
    if not 0 < count <= numel or runs > count or (encoding == RUNS) != (runs > 0):
        raise bad(f"count {count} / runs {runs} out of range for {numel} elements")
    expected = patch_sizes(numel, itemsize, count, runs)[encoding]
    if blob.numel() != expected:
        raise bad(f"{blob.numel()} bytes, expected {expected} for {count} changed elements")
    pos_dtype = np.int32 if _pos_width(numel) == 4 else np.int64
    body = raw[HEADER_BYTES:]
    values = torch.from_numpy(body[len(body) - count * itemsize :].copy()).view(
        _int_dtype(itemsize)
    )
    if encoding == INDEX:
        positions = body[: count * _pos_width(numel)].view(pos_dtype).astype(np.int64)
        if int(positions.min()) < 0 or int(positions.max()) >= numel:
            raise bad(f"an index is outside [0, {numel})")
        if count > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise bad("indices are not strictly increasing")
    elif encoding == MASK:
        flags = np.unpackbits(body[: (numel + 7) // 8], bitorder="little").view(bool)
        if bool(flags[numel:].any()):
            raise bad("mask padding bits are set")
        positions = np.flatnonzero(flags[:numel])
        if positions.size != count:
            raise bad(f"mask marks {positions.size} elements, header says {count}")
    else:
        pairs = body[: runs * 2 * _pos_width(numel)].view(pos_dtype).astype(np.int64)
        run_starts, lengths = pairs[0::2], pairs[1::2]
        if bool((lengths < 1).any()) or bool((run_starts < 0).any()):
            raise bad("a run has a negative start or a length below 1")
        ends = run_starts + lengths
        if bool((ends > numel).any()):
            raise bad(f"a run ends past the tensor's {numel} elements")
        if runs > 1 and bool((run_starts[1:] < ends[:-1]).any()):
            raise bad("runs overlap or are not sorted")
        if int(lengths.sum()) != count:
            raise bad(f"runs cover {int(lengths.sum())} elements, header says {count}")
        before = np.cumsum(lengths) - lengths  # elements in earlier runs
        positions = np.repeat(run_starts - before, lengths) + np.arange(count)
    return Decoded(encoding, torch.from_numpy(positions.astype(np.int64)), values)


def apply_patch(target: torch.Tensor, patch: Decoded) -> None:
    """Write the patch's values into ``target`` (contiguous) at its positions, bit-exact."""
    if not target.is_contiguous():
        raise PayloadError("apply_patch: the target tensor must be contiguous")
    tb = bits(target)
    if tb.device.type == "cpu":
        tb.numpy()[patch.positions.numpy()] = patch.values.numpy()
    else:
        tb[patch.positions.to(tb.device)] = patch.values.to(tb.device)
