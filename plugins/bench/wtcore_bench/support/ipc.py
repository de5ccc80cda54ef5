"""``wtcore bench --backend ipc``: its limit ``shm_copy`` (one copy out of a shared-memory
segment, the ceiling of the CPU path) and ``--engine-option shared_weights=true``."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from wtcore.errors import PayloadError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench
from wtcore_bench.limits import copy_session, session_gbps

__all__ = ["BENCH", "shared_weights", "shm_copy_gbps", "shm_copy_session"]


@contextlib.contextmanager
def shm_copy_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    import mmap

    from wtcore_ipc.shm import SHM_DIR

    size = max(ctx.nbytes, 1)
    fd, path = tempfile.mkstemp(prefix="wtcore-bench-", dir=SHM_DIR)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm, copy_session(mm, ctx.nbytes) as copy:
            yield copy
    finally:
        os.close(fd)
        os.unlink(path)


def shm_copy_gbps(ctx: BaselineContext, repeats: int = 3) -> float:
    return session_gbps(shm_copy_session, ctx, repeats)


def shared_weights(model: Any, value: Any) -> AbstractContextManager[object]:
    """The trainer's model in shared memory for the configuration's rounds."""
    if value not in (True, False):
        raise PayloadError(f"--engine-option shared_weights: expected true or false, got {value!r}")
    if not value:
        return contextlib.nullcontext()
    from wtcore_ipc.shared import share_weights

    return share_weights(model)


#: ``engine.ipc`` in ``wtcore.bench``: no rendezvous, so the default init info serves.
BENCH = EngineBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "shm_copy": Baseline(
            "one copy out of shared memory", shm_copy_gbps, session=shm_copy_session
        )
    },
    devices=("cpu", "cuda"),
    model_options={"shared_weights": shared_weights},
)
