"""``delta="auto"``: a delta round only when earlier rounds measured it faster.

A delta round is expected to take ``encode x rate + wire`` full rounds (docs/architecture.md,
"Delta rounds"). The mode that lost is probed again with exponential backoff because each
measurement can only move with its own mode: a faster link shows only in a full round, denser
updates only in a delta round.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROBE_FIRST", "PROBE_MAX", "AutoDelta"]

#: Rounds after which the mode that lost is measured again; doubles each time it loses again.
PROBE_FIRST = 8
PROBE_MAX = 64


@dataclass
class AutoDelta:
    """The measurements of earlier rounds, and the choice they make."""

    #: Model bytes per second of the last full round.
    rate: float | None = None
    #: Seconds of version check and encoding per model byte, in the last delta round.
    encode: float | None = None
    #: The rest of the last delta round's time, in full rounds at the rate measured before it.
    wire: float | None = None
    #: Rounds until the mode that lost is measured again, and the next such wait.
    wait: int = 0
    backoff: int = PROBE_FIRST

    def ratio(self) -> float | None:
        """A delta round's expected time over a full round's, or ``None`` before both ran."""
        if self.rate is None or self.encode is None or self.wire is None:
            return None
        return self.encode * self.rate + self.wire

    def winner(self) -> str | None:
        r = self.ratio()
        return None if r is None else "delta" if r < 1.0 else "full"

    def choose(self) -> tuple[str, str]:
        """This round's mode (``"delta"`` or ``"full"``) and why, in words with the numbers."""
        winner = self.winner()
        if winner is None:
            what = "a full round" if self.rate is None else "a delta round"
            return ("full" if self.rate is None else "delta"), f"auto: measuring {what}"
        assert self.encode is not None and self.rate is not None and self.wire is not None
        numbers = (
            f"expected delta {self.ratio():.2f}x a full round (encoding "
            f"{self.encode * self.rate:.2f}x, wire {self.wire:.2f}x)"
        )
        if self.wait <= 0:
            loser = "full" if winner == "delta" else "delta"
            return loser, f"auto: measuring {loser} again; {numbers}"
        return winner, f"auto: {numbers}"

    def refresh_base(self) -> bool:
        """Whether a full round must keep a base: the next round may measure a delta round."""
        return self.rate is None or self.encode is None or self.wait <= 1

    def measured(self, mode: str, model_bytes: int, seconds: float, added: float) -> None:
        """Record a completed round; ``added`` is its version check and encoding time."""
        if model_bytes <= 0 or seconds <= 0:
            return
        before = self.winner()
        if mode == "full":
            self.rate = model_bytes / seconds
        elif self.rate is not None:
            self.encode = added / model_bytes
            self.wire = max(0.0, seconds - added) * self.rate / model_bytes
        after = self.winner()
        if before is None or after is None:
            self.wait = self.backoff
        elif mode != before:  # a probe of the mode that lost
            if after == mode:  # it wins now: switch, and watch the other one soon
                self.backoff = PROBE_FIRST
            else:
                self.backoff = min(2 * self.backoff, PROBE_MAX)
            self.wait = self.backoff
        else:
            self.wait -= 1
