"""Frame headers: the sender says how many bytes come next before it sends them.

Every message of a streamed engine (:mod:`wtcore_channel`) is a *frame*: a header, then the
bytes it describes. A broadcast is only safe when both ends post buffers of the same size:
gloo aborts the whole receiving process when more bytes arrive than the receive buffer holds,
and silently leaves the tail of the buffer stale when fewer arrive. The receiver plans its
buckets from the announced metadata, but it must not trust that the sender's bytes match
that plan. So before
each bucket (or each tensor, unpacked) the sender broadcasts a fixed-size header computed
from the very tensor it is about to broadcast: a magic number, the bucket index, its byte
count and a CRC-32 of its bytes. The receiver receives the header first, refuses a header
that does not match its plan *before* it posts the receive (so gloo never sees a mismatched
buffer), and checks the CRC after the bytes arrived, before anything is unpacked. A round
ends with an end header (index = number of buckets, 0 bytes), so a sender with more or
fewer buckets than planned is refused too.

The CRC is optional (the trainer's ``checksum`` option, off by default): it is a full extra
pass over every byte on both ends, slower than the transport itself on a small host
(docs/benchmarks.md), while sizes and index, which keep the transport from aborting or
leaving stale bytes, cost nothing. It is computed on CPU buffers only: on a CUDA buffer it
would cost a device-to-host copy of every bucket, so a CUDA buffer's header always carries
``-1`` (not computed). A receiver stages a bucket whose header carries a CRC
(never receiving it in place), so torn bytes are refused before anything of the bucket is
applied.
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

#: ``b"wtcnccl1"`` as a big-endian int64 (its first engine's name; the wire keeps it): a header
#: that is not one is refused.
MAGIC = int.from_bytes(b"wtcnccl1", "big")
#: int64 words in a header: magic, index, nbytes, crc.
HEADER_WORDS = 4
#: The CRC word of a header whose bytes were not digested (CUDA buffers).
NO_CRC = -1


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
    """The header of ``data`` (flat uint8) as bucket ``index``; ``None`` is the end header.

    Without ``checksum`` the CRC word is :data:`NO_CRC` (sizes and index are always there).
    """
    import torch

    nbytes = 0 if data is None else data.numel()
    crc = 0 if data is None else bytes_crc(data) if checksum else NO_CRC
    return torch.tensor([MAGIC, index, nbytes, crc], dtype=torch.int64, device=device)


def check_header(header: torch.Tensor, *, index: int, nbytes: int, what: str) -> int:
    """Check a received header against the plan; return its CRC word.

    Raises :class:`TransferError` naming ``what`` (the bucket) and both sizes when the sender
    is about to send something else than planned, so the caller never posts the receive.
    """
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
