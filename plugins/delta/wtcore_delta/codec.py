"""The patch codec: what changed in one tensor, as a self-describing ``uint8`` blob.

Elements are compared and copied as integers of their width (:func:`bits`), so NaN payloads and
``-0.0`` travel exactly. Positions are ``INDEX`` (sorted int32/int64 flat indices), ``MASK``
(one bit per element, little-endian bit order) or ``RUNS`` (``(start, length)`` pairs), the
smallest per tensor. Layout (little-endian)::

    magic "WTDP" | format u8 | encoding u8 | itemsize u8 | 0 u8 |
    numel u64 | count u64 | runs u64 | positions ... | values (count * itemsize bytes)

:func:`decode` checks everything (it comes off the network) before :func:`apply_patch` writes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import numpy as np
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
    "plan",
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


def encode(
    new: torch.Tensor, base: torch.Tensor, *, scratch: np.ndarray[Any, Any] | None = None
) -> tuple[Encoded, torch.Tensor | None]:
    """:func:`plan` with its second half run at once: the outcome and, for a patch, the
    changed flat indices (so the caller updates its base without comparing again)."""
    enc, finish = plan(new, base, scratch=scratch)
    return enc, finish() if finish is not None else None


def plan(
    new: torch.Tensor, base: torch.Tensor, *, scratch: np.ndarray[Any, Any] | None = None
) -> tuple[Encoded, Callable[[], torch.Tensor] | None]:
    """Compare ``new`` with ``base`` (same dtype, shape, device) and size the smallest form;
    for a patch also a ``finish`` (run once, before ``blob`` is read) that completes the blob
    and returns the changed flat indices.

    On the CPU a bitmask patch defers its gather to ``finish`` (which compares again: ``base``
    must not change in between), so a trainer gathers while earlier buckets are on the wire.
    Positions are computed with numpy (far faster bit operations than torch on CPU).
    ``scratch``, a reused bool array of at least ``new.numel()``, saves a page fault per page.
    """
    import numpy as np
    import torch

    nb, bb = bits(new), bits(base)
    numel, itemsize = nb.numel(), nb.element_size()
    on_cpu = nb.device.type == "cpu" and bb.device.type == "cpu"

    def compare() -> np.ndarray[Any, Any]:
        result: np.ndarray[Any, Any]
        if not on_cpu:
            result = (nb != bb).cpu().numpy()
            return result
        out = None
        if scratch is not None and scratch.dtype == np.bool_ and scratch.size >= numel:
            out = scratch[:numel]
        result = np.not_equal(nb.numpy(), bb.numpy(), out=out)
        return result

    mask = compare()
    count = int(np.count_nonzero(mask))
    if count == 0:
        return Encoded("same", 0), None
    full = numel * itemsize
    if min(patch_sizes(numel, itemsize, count, 0).values()) >= full:
        return Encoded("full", count), None  # runs cost at least one pair too
    # A run starts where a set flag follows a clear one: one compare of int8 views.
    flags = mask.view(np.int8)
    runs = int(np.count_nonzero(flags[1:] > flags[:-1])) + int(flags[0])
    sizes = patch_sizes(numel, itemsize, count, runs)
    encoding = min(sizes, key=lambda k: sizes[k])
    if sizes[encoding] >= full:
        return Encoded("full", count), None
    pos_dtype = np.int32 if _pos_width(numel) == 4 else np.int64
    # The blob is written in place: header, positions, values; no concatenation pass.
    raw = np.empty(sizes[encoding], dtype=np.uint8)
    raw[:HEADER_BYTES] = np.frombuffer(
        _HEADER.pack(
            MAGIC, FORMAT, encoding, itemsize, 0, numel, count, runs if encoding == RUNS else 0
        ),
        dtype=np.uint8,
    )
    body = raw[HEADER_BYTES : len(raw) - count * itemsize]
    values = raw[len(raw) - count * itemsize :]

    def gather(idx_np: np.ndarray[Any, Any]) -> torch.Tensor:
        # Positions, then a gather by them: numpy's boolean indexing is several times slower.
        if on_cpu:
            np.take(nb.numpy(), idx_np, out=values.view(nb.numpy().dtype))
        else:
            values[:] = nb[torch.from_numpy(idx_np).to(nb.device)].cpu().numpy().view(np.uint8)
        return torch.from_numpy(idx_np).to(nb.device)

    blob = torch.from_numpy(raw)
    if encoding == MASK:
        body[:] = np.packbits(mask, bitorder="little")
        if not on_cpu:  # deferring would keep a device copy of the base alive: gather now
            gathered = gather(np.flatnonzero(mask))
            return Encoded("patch", count, blob, encoding), lambda: gathered

        def finish_mask() -> torch.Tensor:
            again = compare()
            if int(np.count_nonzero(again)) != count:
                raise PayloadError("delta patch: a tensor or its base changed while encoding")
            return gather(np.flatnonzero(again))

        return Encoded("patch", count, blob, encoding), finish_mask
    idx_np = np.flatnonzero(mask)
    if encoding == INDEX:
        body.view(pos_dtype)[:] = idx_np
    else:
        edges = np.flatnonzero(np.diff(flags, prepend=0, append=0))
        pairs = body.view(pos_dtype).reshape(runs, 2)
        pairs[:, 0] = edges[0::2]
        pairs[:, 1] = edges[1::2] - edges[0::2]
    idx = gather(idx_np)
    return Encoded("patch", count, blob, encoding), lambda: idx


@dataclass(frozen=True)
class Decoded:
    """A checked patch: flat int64 ``positions`` (sorted, in bounds) and raw ``values``."""

    encoding: int
    positions: torch.Tensor
    values: torch.Tensor


def decode(blob: torch.Tensor, target: torch.Tensor, *, name: str) -> Decoded:
    """Parse and check ``blob`` against the tensor it will patch (writes nothing)."""
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
        marked = int(np.count_nonzero(flags[:numel]))
        if marked != count:
            raise bad(f"mask marks {marked} elements, header says {count}")
        positions = np.flatnonzero(flags[:numel])
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
    return Decoded(encoding, torch.from_numpy(positions.astype(np.int64, copy=False)), values)


def apply_patch(target: torch.Tensor, patch: Decoded) -> None:
    """Write the patch's values into ``target`` (contiguous) at its positions, bit-exact."""
    if not target.is_contiguous():
        raise PayloadError("apply_patch: the target tensor must be contiguous")
    tb = bits(target)
    if tb.device.type == "cpu":
        tb.numpy()[patch.positions.numpy()] = patch.values.numpy()
    else:
        tb[patch.positions.to(tb.device)] = patch.values.to(tb.device)
