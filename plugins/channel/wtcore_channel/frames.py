"""Frame headers: the sender says how many bytes come next before it sends them.

A header (magic, bucket index, byte count, CRC-32 or :data:`NO_CRC`) is computed from the very
tensor sent next; the receiver refuses one that does not match its plan *before* posting the
receive, since gloo aborts the process on a bigger message and leaves stale bytes on a
smaller one. A round ends with an end header (index = number of buckets, 0 bytes). The CRC
(``checksum``) covers CPU buffers only: on CUDA it would cost a copy to the host. docs/nccl.md.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from wtcore.errors import TransferError

if TYPE_CHECKING:
    import torch

__all__ = [
    "HEADER_WORDS",
    "MAGIC",
    "NO_CRC",
    "bytes_crc",
    "check_crc",
    "check_header",
    "make_header",
]

#: ``b"wtcnccl1"`` as a big-endian int64 (its first engine's name; the wire keeps it).
MAGIC = int.from_bytes(b"wtcnccl1", "big")
HEADER_WORDS = 4  # int64 words: magic, index, nbytes, crc
NO_CRC = -1  # the CRC word of bytes not digested


def bytes_crc(data: torch.Tensor) -> int:
    """CRC-32 of a flat uint8 tensor's bytes, or :data:`NO_CRC` when it is not on the CPU."""
    if data.device.type != "cpu":
        return NO_CRC
    if data.numel() == 0:
        return 0
    return zlib.crc32(memoryview(data.numpy()))  # type: ignore[arg-type]


def make_header(
    index: int, data: torch.Tensor | None, device: str, *, checksum: bool = True
) -> torch.Tensor:
    """The header of ``data`` (flat uint8) as bucket ``index``; ``None`` is the end header."""
    import torch

    nbytes = 0 if data is None else data.numel()
    crc = 0 if data is None else bytes_crc(data) if checksum else NO_CRC
    return torch.tensor([MAGIC, index, nbytes, crc], dtype=torch.int64, device=device)


def check_header(header: torch.Tensor, *, index: int, nbytes: int, what: str) -> int:
    """Check a received header against the plan (before the receive is posted); its CRC word."""
    magic, got_index, got_nbytes, crc = (int(v) for v in header.tolist())
    if magic != MAGIC:
        raise TransferError(f"{what}: the sender's frame header is malformed (magic {magic:#x})")
    if got_index != index or got_nbytes != nbytes:
        raise TransferError(
            f"{what}: the sender announced bucket {got_index} with {got_nbytes} bytes, this "
            f"receiver planned bucket {index} with {nbytes} bytes from the update's metadata; "
            "refusing the round before receiving"
        )
    return crc


def check_crc(data: torch.Tensor, crc: int, *, what: str) -> None:
    """Refuse received bytes whose CRC-32 differs from the header's (skipped for NO_CRC)."""
    if crc == NO_CRC:
        return
    got = bytes_crc(data)
    if got not in (crc, NO_CRC):
        raise TransferError(
            f"{what}: CRC-32 of the received bytes is {got:08x}, the sender's header says "
            f"{crc:08x} (torn or stale bytes); nothing of this bucket was applied"
        )
