"""What one ``send_weights`` did, phase by phase."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from wtcore.errors import PayloadError

__all__ = ["PHASES", "ROUND_TIMES", "TransferStats"]

#: The phases every engine accounts for. Time not spent in one of them is "other".
PHASES: tuple[str, ...] = ("materialize", "pack", "wire", "load", "control")
#: What every receiver reports of its last finished round, in seconds (docs/staged.md).
ROUND_TIMES: tuple[str, ...] = ("staged_s", "commit_s", "paused_s")


@dataclass
class TransferStats:
    """Bytes, tensors, buckets and seconds per phase of one transfer; ``seconds`` is the wall
    time, so phases may overlap (pipelining) or not add up."""

    backend: str = ""
    num_bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    #: With delta rounds on (wtcore-delta): the round's mode, why, density; else None.
    delta: dict[str, Any] | None = None
    #: With ``verify=True``: the bytes each receiver counted as landed (``wtcore.ledger``).
    bytes_landed: list[int] | None = None
    #: With a sharded source: the payload bytes this trainer rank packed and sent.
    bytes_sent: int | None = None
    #: Each receiver's :data:`ROUND_TIMES` of this round; None when the client cannot inspect.
    receiver_times: list[dict[str, Any]] | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.phase_seconds:
            raise PayloadError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] += time.perf_counter() - t0

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9 bytes) per second of wall time."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}
