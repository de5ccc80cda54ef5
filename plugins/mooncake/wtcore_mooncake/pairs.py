"""Sharded rounds on mooncake: every trainer rank packs its pairs' buckets into registered slots,
step by step, and each receiver reads the buckets it needs.

Why steps of packed buckets: pull is this engine's direction (:mod:`wtcore_mooncake.trainer`),
and a receiver's slice of a tensor is, on a trainer rank, often not one contiguous region
(a receiver splitting by columns what the trainer splits by rows needs one row at a time).
Read in place, that is one read per row, about 28 µs each over Mooncake's TCP transport: slower
than gathering on rank 0. Packed by the trainer rank, it is one read per bucket. A trainer rank
has ``packed_num_buffers`` slots (no more memory than a round of the other engines), so the
round goes in the steps of :func:`wtcore_kit.sharded.schedule.schedule_pairs`, which every rank
computes alike from the plan: at most that many buckets per trainer rank and per receiver in a
step. In each step every trainer rank packs its buckets of the step into its slots, rank 0
tells each receiver which slot of which rank holds which of its buckets (one rank-indexed
``update_weights``, ``{"reads": [{"src", "bucket", "slot"}]}``), each receiver reads them and
returns, and only then does any rank pack the next step.

Before the first step rank 0 sends every rank's endpoint and slots (``{"senders":
[{"endpoint": "host:port", "slots": [[address, bytes]]}]}``), so a receiver checks every read
against what was announced: the slot exists, the planned bucket fits in it, and the bucket is
the next of that sender's, of its planned size (:class:`~wtcore_kit.sharded.pairs.PairAssembler`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from wtcore.errors import PayloadError
from wtcore.sharded.layout import is_int

__all__ = ["MAX_SLOTS", "Read", "ReadsUpdate", "SendersUpdate"]

_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9_.:\-\[\]]{1,253}):(?P<port>[0-9]{1,5})")
_ADDRESS_LIMIT = 1 << 63
#: The most slots one trainer rank may announce.
MAX_SLOTS = 64


@dataclass
class SendersUpdate:
    """Every trainer rank's transfer engine and slots: ``{"endpoint", "slots"}`` each."""

    senders: list[Any]

    def checked(self, ranks: int) -> list[tuple[str, list[tuple[int, int]]]]:
        """Each rank's endpoint and ``(address, bytes)`` slots, every entry checked (a
        ``PayloadError`` naming it), for ``ranks`` trainer ranks."""
        if not isinstance(self.senders, list) or len(self.senders) != ranks:
            got = len(self.senders) if isinstance(self.senders, list) else self.senders
            raise PayloadError(
                f"update_info.senders: the plan has {ranks} trainer ranks, got {got!r:.40} entries"
            )
        out = []
        for i, e in enumerate(self.senders):
            where = f"update_info.senders[{i}]"
            if not isinstance(e, dict) or set(e) != {"endpoint", "slots"}:
                raise PayloadError(f"{where}: expected an object of endpoint and slots")
            m = _ENDPOINT.fullmatch(e["endpoint"]) if isinstance(e["endpoint"], str) else None
            if m is None or not 0 < int(m.group("port")) < 65536:
                raise PayloadError(f"{where}.endpoint: expected host:port")
            slots = e["slots"]
            if not isinstance(slots, list) or not 0 < len(slots) <= MAX_SLOTS:
                raise PayloadError(f"{where}.slots: expected 1 to {MAX_SLOTS} [address, bytes]")
            checked = []
            for j, slot in enumerate(slots):
                ok = isinstance(slot, list) and len(slot) == 2 and all(map(is_int, slot))
                if not ok or not 0 < slot[0] < _ADDRESS_LIMIT or not 0 < slot[1] <= 1 << 40:
                    raise PayloadError(f"{where}.slots[{j}]: expected [address, bytes]")
                checked.append((int(slot[0]), int(slot[1])))
            out.append((e["endpoint"], checked))
        return out


@dataclass(frozen=True)
class Read:
    """Bucket ``bucket`` of trainer rank ``src``'s pair with this receiver, in slot ``slot``."""

    src: int
    bucket: int
    slot: int


@dataclass
class ReadsUpdate:
    """One step of a sharded round for this receiver: the buckets to read, in order."""

    reads: list[Any]

    def checked(self) -> list[Read]:
        """The reads, each an object of three integers (a ``PayloadError`` naming it); what
        they name is checked against the plan and the slots by the receiver."""
        if not isinstance(self.reads, list) or len(self.reads) > MAX_SLOTS * 1024:
            raise PayloadError("update_info.reads: expected a list of reads")
        out = []
        for i, r in enumerate(self.reads):
            if not isinstance(r, dict) or set(r) != {"src", "bucket", "slot"}:
                raise PayloadError(
                    f"update_info.reads[{i}]: expected an object of src, bucket, slot"
                )
            if not all(is_int(v) and v >= 0 for v in r.values()):
                raise PayloadError(
                    f"update_info.reads[{i}]: src, bucket and slot must be integers >= 0"
                )
            out.append(Read(r["src"], r["bucket"], r["slot"]))
        return out
