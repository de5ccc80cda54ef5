"""Peak extra resident memory of a process during a round (Linux ``/proc``; else ``None``).

Writing ``5`` to ``/proc/PID/clear_refs`` resets the peak (``VmHWM``) to the current RSS, so
``peak - rss_before`` is what the round added.
"""

from __future__ import annotations

__all__ = ["PeakTracker"]


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakTracker:
    """Tracks the peak extra RSS of a set of PIDs across one measured section."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._before: dict[int, int | None] = {}

    def start(self) -> None:
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            self._before[pid] = _status_kib(pid, "VmRSS")

    def extra_mib(self) -> list[float | None]:
        out: list[float | None] = []
        for pid in self.pids:
            before, peak = self._before.get(pid), _status_kib(pid, "VmHWM")
            out.append(None if before is None or peak is None else max(0, peak - before) / 1024)
        return out
