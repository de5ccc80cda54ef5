"""``wtcore bench --backend nccl``: the engine's bench API and the baselines that matter for it.

* ``raw_gloo``: one preallocated buffer of the model's size broadcast over plain gloo, the
  ceiling of this engine's CPU path;
* ``per_tensor``: the naive loop users still run: for every tensor a blocking control call,
  then a broadcast into freshly allocated memory, then a copy into the model.

Both start their own receiver processes (``spawn``) and always reap them. Nothing here is
imported until the bench asks (the trainer module holds only an :class:`NCCLBench` instance).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from wtcore.bench.api import Baseline, BaselineContext, EngineBench
from wtcore.procs import stop_processes

if TYPE_CHECKING:
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["BENCH", "NCCLBench", "per_tensor_gbps", "raw_gloo_gbps"]


def _group(rank: int, world: int, host: str, port: int, timeout_s: float) -> Any:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s)
    )
    torch.set_num_threads(1)
    return dist.ProcessGroupGloo(
        dist.PrefixStore("wtcore-bench", store),  # type: ignore[attr-defined]
        rank,
        world,
        timedelta(seconds=timeout_s),
    )


def _raw_receiver(
    rank: int, world: int, host: str, port: int, timeout_s: float, nbytes: int, repeats: int
) -> None:
    import torch

    pg = _group(rank, world, host, port, timeout_s)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        pg.broadcast(buf, 0).wait()


def raw_gloo_gbps(ctx: BaselineContext, repeats: int = 3) -> float:
    """One preallocated buffer broadcast from this process to ``ctx.receivers`` processes."""
    import torch

    from wtcore.bench.limits import median_gbps
    from wtcore.net import free_port

    port = free_port(ctx.host)
    world = ctx.receivers + 1
    args = (world, ctx.host, port, ctx.timeout_s, ctx.nbytes, repeats)
    procs = _spawn(_raw_receiver, ctx.receivers, args)
    try:
        threads = torch.get_num_threads()
        pg = _group(0, *args[:4])
        try:
            buf = torch.ones(ctx.nbytes, dtype=torch.uint8)
            pg.broadcast(buf, 0).wait()  # warm-up
            return median_gbps(ctx.nbytes, lambda: pg.broadcast(buf, 0).wait(), repeats)
        finally:
            torch.set_num_threads(threads)
    finally:
        stop_processes(procs, 30.0)


def _naive_receiver(
    rank: int,
    world: int,
    host: str,
    port: int,
    timeout_s: float,
    metas: list[tuple[str, str, list[int]]],
    conn: Any,
    repeats: int,
) -> None:
    import torch

    from wtcore.meta import dtype_from_name

    pg = _group(rank, world, host, port, timeout_s)
    model = {n: torch.zeros(s, dtype=dtype_from_name(d)) for n, d, s in metas}
    for _ in range(repeats + 1):
        for _name in model:
            name, dname, shape = conn.recv()  # the control call for this tensor
            conn.send("ok")
            fresh = torch.empty(shape, dtype=dtype_from_name(dname))
            pg.broadcast(fresh, 0).wait()
            model[name].copy_(fresh)


def per_tensor_gbps(ctx: BaselineContext, repeats: int = 2) -> float:
    """The naive baseline: a blocking control call and a fresh broadcast per tensor."""
    import torch

    from wtcore.bench.limits import median_gbps
    from wtcore.errors import TransferTimeoutError
    from wtcore.meta import dtype_name
    from wtcore.net import free_port

    port = free_port(ctx.host)
    world = ctx.receivers + 1
    pipes = [mp.get_context("spawn").Pipe() for _ in range(ctx.receivers)]
    metas = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in ctx.state.items()]
    procs = _spawn(
        _naive_receiver,
        ctx.receivers,
        (world, ctx.host, port, ctx.timeout_s, metas),
        per_rank=[(child, repeats) for _, child in pipes],
    )
    try:
        threads = torch.get_num_threads()
        pg = _group(0, world, ctx.host, port, ctx.timeout_s)

        def run() -> None:
            for (name, dname, shape), t in zip(metas, ctx.state.values(), strict=True):
                for parent, _ in pipes:
                    parent.send((name, dname, shape))
                for parent, _ in pipes:
                    if not parent.poll(ctx.timeout_s):
                        raise TransferTimeoutError(
                            f"per_tensor baseline: a receiver did not answer within "
                            f"{ctx.timeout_s}s"
                        )
                    parent.recv()
                pg.broadcast(t.contiguous(), 0).wait()

        try:
            run()  # warm-up
            return median_gbps(ctx.nbytes, run, repeats)
        finally:
            torch.set_num_threads(threads)
    finally:
        stop_processes(procs, 30.0)


def _spawn(
    target: Callable[..., None],
    receivers: int,
    args: tuple[Any, ...],
    per_rank: list[tuple[Any, ...]] | None = None,
) -> list[Any]:
    """Receivers ``1 .. receivers`` as ``target(rank, *args, *per_rank[rank - 1])``."""
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(receivers):
        extra = per_rank[i] if per_rank is not None else ()
        p = ctx.Process(target=target, args=(i + 1, *args, *extra), daemon=True)
        p.start()
        procs.append(p)
    return procs


@dataclass(frozen=True)
class NCCLBench(EngineBench):
    """The sender hosts the rendezvous on ``host`` at a free port; every receiver joins it."""

    def init_info(
        self,
        engine: type[TrainerWeightTransferEngine],
        *,
        receivers: int,
        host: str,
        buffer_size_bytes: int | None,
    ) -> TrainerInitInfo:
        from wtcore.net import free_port
        from wtcore_nccl.config import DEFAULT_BUFFER_SIZE, NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            rank=0,
            master_address=host,
            master_port=free_port(host),
            world_size=receivers + 1,
            packed_buffer_size_bytes=buffer_size_bytes or DEFAULT_BUFFER_SIZE,
        )


#: What ``NCCLTrainerEngine.bench`` is.
BENCH = NCCLBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "raw_gloo": Baseline("raw gloo broadcast", raw_gloo_gbps),
        "per_tensor": Baseline("per-tensor broadcast + control call", per_tensor_gbps),
    },
)
