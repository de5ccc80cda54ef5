"""``wtcore bench --backend mooncake``: its limit ``bare_read``, what is left when wtcore's part
is taken away: every receiver's single ``transfer_sync_read`` of one registered buffer of the
model's size, all at once, with no packing and no control plane.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench, OptionalDependencyError
from wtcore_bench.limits import session_gbps
from wtcore_bench.received import answer, next_message, spawned

if TYPE_CHECKING:
    import torch

    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["BENCH", "MooncakeBench", "bare_read_session", "pattern"]

_LABEL = "bare_read limit"


def pattern(nbytes: int) -> torch.Tensor:
    """``i % 251`` (a prime: no page repeats), tiled so 1 GiB costs 1 GiB, not an int64 index."""
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


def _reader(rank: int, host: str, endpoint: str, remote: int, nbytes: int, conn: Any) -> None:
    import torch

    te = _te()
    torch.set_num_threads(1)
    engine, _ = te.start(te.local_address(host), "tcp")
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    conn.send(engine.register_memory(buf.data_ptr(), buf.numel()))
    reads = 0
    try:
        while next_message(conn) is not None:
            status = engine.transfer_sync_read(endpoint, buf.data_ptr(), remote, nbytes)
            reads += 1
            conn.send(status)
        conn.send((reads, bool(torch.equal(buf[:nbytes], pattern(nbytes)))))
    except (BrokenPipeError, EOFError):  # the sender is gone
        pass
    finally:
        engine.unregister_memory(buf.data_ptr())


@contextlib.contextmanager
def bare_read_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """The ``bare_read`` limit, one read by every receiver per call."""
    te = _te()
    engine, endpoint = te.start(ctx.host, "tcp")
    src = pattern(max(ctx.nbytes, 1))
    if engine.register_memory(src.data_ptr(), src.numel()) != 0:
        raise TransferError(f"{_LABEL}: Mooncake could not register {src.numel()} bytes")
    args = (ctx.host, endpoint, src.data_ptr(), ctx.nbytes)
    try:
        with spawned(_reader, ctx.receivers, *args) as pipes:
            for rank, parent in enumerate(pipes, start=1):
                if (rc := answer(parent, ctx.timeout_s, _LABEL, "registration")) != 0:
                    raise TransferError(
                        f"{_LABEL}: receiver {rank} could not register its buffer (rc {rc})"
                    )
            calls = 0

            def read() -> None:
                nonlocal calls
                for parent in pipes:
                    parent.send(True)
                calls += 1
                for rank, parent in enumerate(pipes, start=1):
                    if (rc := answer(parent, ctx.timeout_s, _LABEL, "end of read")) != 0:
                        raise TransferError(
                            f"{_LABEL}: receiver {rank}'s read from {endpoint} failed (rc {rc})"
                        )

            yield read
            for parent in pipes:
                parent.send(None)
            for rank, parent in enumerate(pipes, start=1):
                got = answer(parent, ctx.timeout_s, _LABEL, "report")
                if got != (calls, True):
                    raise TransferError(
                        f"{_LABEL}: receiver {rank} reported {got!r} (reads, buffer as sent) "
                        f"after {calls} reads"
                    )
    finally:
        engine.unregister_memory(src.data_ptr())


@dataclass(frozen=True)
class MooncakeBench(EngineBench):
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

        buffer: dict[str, Any] = self.buffer_kwargs(engine, buffer_size_bytes)  # {}: default
        return MooncakeTrainerInitInfo(rank=0, address=host, **buffer)


#: ``engine.mooncake`` in ``wtcore.bench``.
BENCH = MooncakeBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "bare_read": Baseline(
            "bare transfer_sync_read, one buffer",
            partial(session_gbps, bare_read_session),
            session=bare_read_session,
        ),
    },
    # --device cuda: the models on the GPU, staged through host memory on both ends
    devices=("cpu", "cuda"),
)
