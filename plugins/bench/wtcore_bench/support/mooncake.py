"""``wtcore bench --backend mooncake``: the engine's bench API and its own limit.

``mooncake_read`` is the bare transfer the engine is built on, in the engine's shape: this (the
trainer's) process registers one buffer of the model's size, and each of ``ctx.receivers``
reader processes reads all of it with one ``transfer_sync_read`` per call, all at once, over
the same protocol. The engine's rounds move the same bytes per receiver with the same calls;
the difference is the engine's own cost: planning, packing into slots, the control calls,
unpacking into the model. Every reader compares what it read with the pattern once per session
(a limit that moved the wrong bytes is no yardstick).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wtcore.errors import TransferError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench, OptionalDependencyError

if TYPE_CHECKING:
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["BENCH", "MooncakeBench", "mooncake_read_gbps", "mooncake_read_session"]

#: A reader: reads the whole buffer per line on stdin, answers "ok" (the first read checked).
_READER = """
import json, sys, torch
from wtcore_mooncake import te
peer = json.loads(sys.argv[1])
engine, _ = te.start(te.local_address(peer["host"]), "tcp")
size = peer["size"]
local = torch.empty(size, dtype=torch.uint8)
assert engine.register_memory(local.data_ptr(), size) == 0
print("ready", flush=True)
first = True
for _ in sys.stdin:
    rc = engine.transfer_sync_read(peer["endpoint"], local.data_ptr(), peer["address"], size)
    if rc == 0 and first:
        rc = 0 if torch.equal(local, (torch.arange(size) % 251).to(torch.uint8)) else -99
        first = False
    print("ok" if rc == 0 else f"status {rc}", flush=True)
"""


def _answer(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != what:
        raise TransferError(
            f"mooncake_read reader (pid {proc.pid}): expected {what!r}, got {line!r}"
        )


@contextlib.contextmanager
def mooncake_read_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """Every reader reads ``ctx.nbytes`` from this process, concurrently, once per call."""
    import torch

    from wtcore.errors import PluginLoadError
    from wtcore.testing.procs import stop_processes

    try:
        from wtcore_mooncake import te

        te.load()
    except (ImportError, PluginLoadError) as e:
        raise OptionalDependencyError(f"mooncake_read needs wtcore-mooncake: {e}") from e
    size = max(ctx.nbytes, 1)
    engine, endpoint = te.start(ctx.host, "tcp")
    buf = (torch.arange(size, dtype=torch.int64) % 251).to(torch.uint8)
    if engine.register_memory(buf.data_ptr(), size) != 0:
        raise TransferError("mooncake_read: could not register the buffer")
    peer = json.dumps(
        {"host": ctx.host, "endpoint": endpoint, "address": buf.data_ptr(), "size": size}
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(max(ctx.receivers, 1)):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _READER, peer],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        for p in procs:
            _answer(p, "ready")

        def read_all() -> None:
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("read\n")
                p.stdin.flush()
            for p in procs:
                _answer(p, "ok")

        read_all()  # the first read of each is checked against the pattern
        yield read_all
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        stop_processes(procs, 10)
        for p in procs:
            if p.stdout is not None:
                p.stdout.close()
        engine.unregister_memory(buf.data_ptr())


def mooncake_read_gbps(ctx: BaselineContext, repeats: int = 3) -> float:
    from wtcore_bench.limits import session_gbps

    return session_gbps(mooncake_read_session, ctx, repeats)


@dataclass(frozen=True)
class MooncakeBench(EngineBench):
    """The trainer's transfer engine listens on ``host``; receivers read from it."""

    def init_info(
        self,
        engine: type[TrainerWeightTransferEngine],
        *,
        receivers: int,
        host: str,
        buffer_size_bytes: int | None,
        device: str = "cpu",
    ) -> TrainerInitInfo:
        from wtcore_mooncake import MooncakeTrainerInitInfo

        info = MooncakeTrainerInitInfo(rank=0, address=host)
        if buffer_size_bytes is not None:
            info.packed_buffer_size_bytes = buffer_size_bytes
            info.__post_init__()  # checked as if given to the constructor
        return info


#: ``mooncake`` in ``wtcore.bench_engines``.
BENCH = MooncakeBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "mooncake_read": Baseline(
            "one transfer_sync_read of the model's size",
            mooncake_read_gbps,
            session=mooncake_read_session,
        )
    },
)
