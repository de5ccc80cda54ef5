"""Sharded rounds on mooncake: every trainer rank packs its pairs' buckets into registered slots,
step by step, and each receiver reads the buckets it needs (docs/mooncake.md, "Sharded rounds").

The updates: first ``{"senders": [{"endpoint": "host:port", "slots": [[address, bytes]]}]}``,
then per step ``{"reads": [{"src", "bucket", "slot"}]}``, each checked before a byte moves.
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
MAX_SLOTS = 64


@dataclass
class SendersUpdate:
    """Every trainer rank's transfer engine and slots: ``{"endpoint", "slots"}`` each."""

    senders: list[Any]

    def checked(self, ranks: int) -> list[tuple[str, list[tuple[int, int]]]]:
        """Each of ``ranks`` trainer ranks' endpoint and ``(address, bytes)`` slots, checked."""
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
        """The reads, each three integers (the receiver checks them against plan and slots)."""
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
