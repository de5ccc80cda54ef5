"""A tiny reader (and writer) of the safetensors format, so ``wtcore serve`` can host a real
checkpoint without a new dependency.

The format: an 8-byte little-endian header length N, N bytes of JSON header
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian bytes, offsets relative to the end of the header. The reader checks
every entry (known dtype, offsets inside the file, size matching the shape) before it builds
any tensor, and never unpickles anything.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import torch

__all__ = ["SAFETENSORS_DTYPES", "load_safetensors", "save_safetensors"]

#: safetensors dtype code -> torch dtype attribute name.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_MAX_HEADER = 100 << 20


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from a ``.safetensors`` file, in the header's order."""
    import torch

    p = Path(path)
    raw = p.read_bytes()
    if len(raw) < 8:
        raise PayloadError(f"{p}: too short for a safetensors file ({len(raw)} bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER or 8 + n > len(raw):
        raise PayloadError(f"{p}: header length {n} does not fit in a {len(raw)}-byte file")
    try:
        header = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"{p}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise PayloadError(f"{p}: header must be a JSON object")
    data = memoryview(raw)[8 + n :]
    plan: list[tuple[str, torch.dtype, list[int], int, int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        plan.append((name, *_check_entry(p, name, entry, len(data))))
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in plan:
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def _check_entry(
    p: Path, name: str, entry: Any, data_len: int
) -> tuple[torch.dtype, list[int], int, int]:
    import torch

    where = f"{p}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise PayloadError(f"{where}: expected dtype, shape and data_offsets, got {entry!r}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in SAFETENSORS_DTYPES or not hasattr(torch, SAFETENSORS_DTYPES[code]):
        raise PayloadError(f"{where}: unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise PayloadError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise PayloadError(f"{where}: data_offsets {offsets!r} out of the data ({data_len} bytes)")
    dtype = getattr(torch, SAFETENSORS_DTYPES[code])
    numel = 1
    for d in shape:
        numel *= d
    size = numel * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != size:
        raise PayloadError(
            f"{where}: {offsets[1] - offsets[0]} bytes for shape {shape} of {code} "
            f"(expected {size})"
        )
    return dtype, shape, offsets[0], offsets[1]


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (CPU, any layout) in the safetensors format."""
    import torch

    codes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        code = codes.get(str(t.dtype).split(".")[-1])
        if code is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code")
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        blob = flat.numpy().tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)
