"""``wait_work``: a broadcast that completes just after a short poll expires is not a failure."""

from __future__ import annotations

import datetime

import pytest

from wtcore import TransferError
from wtcore_nccl.pipeline import wait_work


class LateWork:
    """A work that completes right after the first short wait gives up.

    Real gloo hits this race only by chance (a bucket that takes about one 50 ms poll, on a
    slow link), so the ordering is pinned here with a stand-in for ``dist.Work``.
    """

    def __init__(self, error: str | None = None) -> None:
        self.waits = 0
        self.error = error

    def wait(self, timeout: datetime.timedelta) -> bool:
        self.waits += 1
        if self.waits == 1:
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.waits >= 1


def test_completion_right_after_a_short_wait_is_success() -> None:
    work = LateWork()
    wait_work(work, what="broadcast of bucket 1", timeout_s=5)  # type: ignore[arg-type]
    assert work.waits == 2


def test_a_completed_failure_reports_its_own_error() -> None:
    with pytest.raises(TransferError, match=r"broadcast of bucket 1 failed: Connection reset"):
        wait_work(LateWork("Connection reset by peer"), what="broadcast of bucket 1", timeout_s=5)  # type: ignore[arg-type]
