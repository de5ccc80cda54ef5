"""``wtcore bench --backend mooncake``: the engine's bench API and its limit.

``bare_read`` is the engine's own ceiling: the trainer's transfer engine registers one buffer
of the model's size, every receiver process registers one of its own, and a round is each
receiver's single ``transfer_sync_read`` of the whole buffer, all receivers at once (as the
engine's workers read each bucket). No packing, no control plane, no unpacking: what is left
when wtcore's part is taken away. It has a session, so ``--interleave`` measures it between
the engine's rounds. The buffer holds a known pattern, and after the session every receiver
must report as many reads as were made and the pattern bit for bit (otherwise a
:class:`~wtcore.errors.TransferError`).

Nothing here is imported until the bench asks; Mooncake itself is loaded through
:mod:`wtcore_mooncake.te`, the process's one transfer engine per address.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError, TransferTimeoutError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench, OptionalDependencyError

if TYPE_CHECKING:
    import torch

    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["BENCH", "MooncakeBench", "bare_read_gbps", "bare_read_session", "pattern"]


def pattern(nbytes: int) -> torch.Tensor:
    """The bytes the sender's buffer holds: ``i % 251`` (a prime, so no page repeats); built
    by tiling, so a 1 GiB pattern costs 1 GiB, not an int64 index of 8."""
    import torch

    return torch.arange(251, dtype=torch.uint8).repeat(-(-nbytes // 251))[:nbytes]


def _te() -> Any:
    try:
        from wtcore_mooncake import te
    except ImportError as e:
        raise OptionalDependencyError(
            "the bare_read limit needs the mooncake engine: pip install wtcore-mooncake"
        ) from e
    te.load()  # PluginLoadError (what to install) if Mooncake itself is missing
    return te


def _reader(host: str, endpoint: str, remote: int, nbytes: int, conn: Any) -> None:
    """Register a buffer; per ``True`` from the sender read its buffer into it and answer the
    status; on ``None`` (or a closed pipe) report ``(reads, buffer == pattern)``."""
    import torch

    te = _te()
    torch.set_num_threads(1)
    engine, _ = te.start(te.local_address(host), "tcp")
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    rc = engine.register_memory(buf.data_ptr(), buf.numel())
    conn.send(rc)
    reads = 0
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                break
            status = engine.transfer_sync_read(endpoint, buf.data_ptr(), remote, nbytes)
            reads += 1
            conn.send(status)
        conn.send((reads, bool(torch.equal(buf[:nbytes], pattern(nbytes)))))
    finally:
        engine.unregister_memory(buf.data_ptr())


@contextlib.contextmanager
def bare_read_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """The ``bare_read`` limit, one read by every receiver per call (see the module docstring)."""
    from wtcore.testing.procs import stop_processes

    te = _te()
    engine, endpoint = te.start(ctx.host, "tcp")
    src = pattern(max(ctx.nbytes, 1))
    if engine.register_memory(src.data_ptr(), src.numel()) != 0:
        raise TransferError(f"bare_read limit: Mooncake could not register {src.numel()} bytes")
    spawn = mp.get_context("spawn")
    pipes = [spawn.Pipe() for _ in range(ctx.receivers)]
    procs = []

    def answer(rank: int, parent: Any, what: str) -> Any:
        if not parent.poll(ctx.timeout_s):
            raise TransferTimeoutError(
                f"bare_read limit: receiver {rank} sent no {what} within {ctx.timeout_s}s"
            )
        return parent.recv()

    try:
        for _, child in pipes:
            p = spawn.Process(
                target=_reader,
                args=(ctx.host, endpoint, src.data_ptr(), ctx.nbytes, child),
                daemon=True,
            )
            p.start()
            procs.append(p)
        for rank, (parent, _) in enumerate(pipes, start=1):
            if (rc := answer(rank, parent, "registration")) != 0:
                raise TransferError(
                    f"bare_read limit: receiver {rank} could not register its buffer (rc {rc})"
                )
        calls = 0

        def read() -> None:
            nonlocal calls
            for parent, _ in pipes:
                parent.send(True)
            calls += 1
            for rank, (parent, _) in enumerate(pipes, start=1):
                if (rc := answer(rank, parent, "end of read")) != 0:
                    raise TransferError(
                        f"bare_read limit: receiver {rank}'s read from {endpoint} failed (rc {rc})"
                    )

        yield read
        for parent, _ in pipes:
            parent.send(None)
        for rank, (parent, _) in enumerate(pipes, start=1):
            got = answer(rank, parent, "report")
            if got != (calls, True):
                raise TransferError(
                    f"bare_read limit: receiver {rank} reported {got!r} (reads, buffer as "
                    f"sent) after {calls} reads"
                )
    finally:
        for parent, _ in pipes:
            parent.close()
        stop_processes(procs, 30.0)
        engine.unregister_memory(src.data_ptr())


def bare_read_gbps(ctx: BaselineContext, repeats: int = 3) -> float:
    """The ``bare_read`` limit: see :func:`bare_read_session`."""
    from wtcore_bench.limits import session_gbps

    return session_gbps(bare_read_session, ctx, repeats)


@dataclass(frozen=True)
class MooncakeBench(EngineBench):
    """The trainer's transfer engine listens on ``host``; every receiver reads from it."""

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

        if buffer_size_bytes is None:  # the engine's default bucket size
            return MooncakeTrainerInitInfo(rank=0, address=host)
        return MooncakeTrainerInitInfo(
            rank=0, address=host, packed_buffer_size_bytes=buffer_size_bytes
        )


#: ``engine.mooncake`` in ``wtcore.bench``.
BENCH = MooncakeBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "bare_read": Baseline(
            "bare transfer_sync_read, one buffer", bare_read_gbps, session=bare_read_session
        ),
    },
    # --device cuda: the models on the GPU, staged through CPU memory on both ends (the
    # engine's own staging is host memory); scripts/gpu-check.sh runs it
    devices=("cpu", "cuda"),
)
