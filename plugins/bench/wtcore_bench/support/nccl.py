"""``wtcore bench --backend nccl``: the engine's bench API and the baselines that matter for it.

* ``raw_gloo``: one preallocated buffer of the model's size broadcast over plain gloo, the
  ceiling of this engine's CPU path;
* ``per_tensor``: the naive loop users still run: for every tensor a blocking control call,
  then a broadcast into freshly allocated memory, then a copy into the model;
* ``vllm_packing`` (a peer, ``--baselines peers``): vLLM's packed broadcast, rebuilt from its
  description over the same kind of gloo group: buckets of a target size, each a fresh
  ``torch.cat`` of flattened ``uint8`` views, broadcast with two buckets in flight; the
  receiver allocates ``torch.empty`` per bucket, unpacks dtype views and copies them into the
  model. It is what a user of vLLM's own engine gets, so wtcore's ratio to it is the gain.

All start their own receiver processes (``spawn``) and always reap them; ``vllm_packing``
checks every receiver's digests after the last round (a mismatch is a
:class:`~wtcore.errors.TransferError`). Nothing here is imported until the bench asks (the
trainer module holds only an :class:`NCCLBench` instance).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError
from wtcore.testing.procs import stop_processes
from wtcore_bench.api import Baseline, BaselineContext, EngineBench
from wtcore_bench.received import Spec

if TYPE_CHECKING:
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = [
    "BENCH",
    "NCCLBench",
    "per_tensor_gbps",
    "per_tensor_session",
    "raw_gloo_gbps",
    "raw_gloo_session",
    "vllm_packing_gbps",
    "vllm_packing_run",
]

#: Broadcasts a vLLM-style sender or receiver keeps in flight (its double buffering).
_VLLM_IN_FLIGHT = 2


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
    rank: int,
    world: int,
    host: str,
    port: int,
    timeout_s: float,
    _spec: Spec,
    nbytes: int,
    conn: Any,
) -> None:
    """Receive a broadcast into one buffer per ``True`` from the sender until it sends
    ``None`` (or its pipe closes), then report how many arrived and whether the buffer holds
    what the sender sent (ones)."""
    import torch

    pg = _group(rank, world, host, port, timeout_s)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    count = 0
    while _next_message(conn) is not None:  # True: one more broadcast
        pg.broadcast(buf, 0).wait()
        count += 1
    lo, hi = torch.aminmax(buf) if nbytes and count else (1, 1)
    conn.send((count, int(lo) == int(hi) == 1))


def _next_message(conn: Any) -> Any:
    """The sender's next message; ``None`` (stop) also when its end of the pipe closed."""
    try:
        return conn.recv()
    except EOFError:
        return None


@contextlib.contextmanager
def _receivers(
    ctx: BaselineContext, target: Callable[..., None], args: tuple[Any, ...] = ()
) -> Iterator[tuple[Any, list[Any], Spec]]:
    """Receiver processes running ``target`` (see :func:`_start_receivers`, with a pipe
    each), and this process's end of their gloo group: yields the group, the pipes and the
    model's spec. The receivers are reaped on any exit; telling them to stop is the
    caller's."""
    import torch

    port, world, pipes, metas, procs = _start_receivers(ctx, target, args, lambda child: (child,))
    try:
        threads = torch.get_num_threads()
        pg = _group(0, world, ctx.host, port, ctx.timeout_s)
        torch.set_num_threads(threads)  # the caller's setting governs its own rounds
        yield pg, [parent for parent, _ in pipes], metas
    finally:
        for parent, _ in pipes:
            parent.close()
        stop_processes(procs, 30.0)


@contextlib.contextmanager
def raw_gloo_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """One preallocated buffer broadcast from this process to ``ctx.receivers`` processes,
    once per call of what it yields; on exit every receiver must have received each of them
    and hold the sender's bytes (:class:`~wtcore.errors.TransferError` otherwise). Each
    broadcast is announced to the receivers over a pipe (microseconds against the
    broadcast's fraction of a second), so between calls they idle with no receive posted,
    however long the engine's rounds in between take."""
    import torch

    with _receivers(ctx, _raw_receiver, (ctx.nbytes,)) as (pg, pipes, _):
        buf = torch.ones(ctx.nbytes, dtype=torch.uint8)
        calls = 0

        def broadcast() -> None:
            nonlocal calls
            for parent in pipes:
                parent.send(True)
            pg.broadcast(buf, 0).wait()
            calls += 1

        yield broadcast
        for parent in pipes:
            parent.send(None)
        for rank, parent in enumerate(pipes, start=1):
            got = parent.recv() if parent.poll(ctx.timeout_s) else None
            if got != (calls, True):
                raise TransferError(
                    f"raw_gloo baseline: receiver rank {rank} reported {got!r} (broadcasts "
                    f"received, buffer as sent) after {calls} broadcasts"
                )


def raw_gloo_gbps(ctx: BaselineContext, repeats: int = 3) -> float:
    """The ``raw_gloo`` limit: see :func:`raw_gloo_session`."""
    from wtcore_bench.limits import session_gbps

    return session_gbps(raw_gloo_session, ctx, repeats)


def _naive_receiver(
    rank: int,
    world: int,
    host: str,
    port: int,
    timeout_s: float,
    metas: list[tuple[str, str, list[int]]],
    conn: Any,
) -> None:
    """Rounds of the naive loop until the sender sends ``None`` before a round's first
    tensor (or its pipe closes)."""
    import torch

    from wtcore.meta import dtype_from_name
    from wtcore_bench.received import zeros_from_spec

    pg = _group(rank, world, host, port, timeout_s)
    model = zeros_from_spec(metas)
    while True:
        for _name in model:
            if (call := _next_message(conn)) is None:  # the control call for this tensor
                return
            name, dname, shape = call
            conn.send("ok")
            fresh = torch.empty(shape, dtype=dtype_from_name(dname))
            pg.broadcast(fresh, 0).wait()
            model[name].copy_(fresh)


@contextlib.contextmanager
def per_tensor_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """The naive baseline, one round per call of what it yields: for every tensor a
    blocking control call, then a broadcast into freshly allocated memory on each receiver,
    then a copy into its model."""
    from wtcore.errors import TransferTimeoutError

    with _receivers(ctx, _naive_receiver) as (pg, pipes, metas):

        def run() -> None:
            for (name, dname, shape), t in zip(metas, ctx.state.values(), strict=True):
                for parent in pipes:
                    parent.send((name, dname, shape))
                for parent in pipes:
                    if not parent.poll(ctx.timeout_s):
                        raise TransferTimeoutError(
                            f"per_tensor baseline: a receiver did not answer within "
                            f"{ctx.timeout_s}s"
                        )
                    parent.recv()
                pg.broadcast(t.contiguous(), 0).wait()

        yield run
        for parent in pipes:
            parent.send(None)


def per_tensor_gbps(ctx: BaselineContext, repeats: int = 2) -> float:
    """The naive baseline: see :func:`per_tensor_session`."""
    from wtcore_bench.limits import session_gbps

    return session_gbps(per_tensor_session, ctx, repeats)


def vllm_buckets(sizes: list[int], target: int) -> list[tuple[int, int]]:
    """vLLM's bucket rule: ``[start, stop)`` index runs; one closes once it exceeds ``target``.

    Deliberately *not* :func:`wtcore.buckets.plan_round`: this is a peer's rule (vLLM's packed
    broadcast closes a bucket after the tensor that overflows it, unaligned), reproduced so
    the ``vllm`` baseline measures vLLM's own schedule, not ours.
    """
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > target:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def _vllm_receiver(
    rank: int,
    world: int,
    host: str,
    port: int,
    timeout_s: float,
    metas: list[tuple[str, str, list[int]]],
    target: int,
    device: str,
    repeats: int,
    send_model: bool,
    conn: Any,
) -> None:
    import torch

    from wtcore.digest import digest_named
    from wtcore_bench.received import raw_state, zeros_from_spec

    pg = _group(rank, world, host, port, timeout_s)
    model = zeros_from_spec(metas, device)
    params = list(model.values())
    sizes = [t.numel() * t.element_size() for t in params]
    buckets = vllm_buckets(sizes, target)

    def post(start: int, stop: int) -> tuple[Any, Any, int, int]:
        fresh = torch.empty(sum(sizes[start:stop]), dtype=torch.uint8, device=device)
        return pg.broadcast(fresh, 0), fresh, start, stop

    for _ in range(repeats + 1):
        pending = [post(*b) for b in buckets[:_VLLM_IN_FLIGHT]]
        for k in range(len(buckets)):
            work, packed, start, stop = pending.pop(0)
            work.wait()
            if k + _VLLM_IN_FLIGHT < len(buckets):
                pending.append(post(*buckets[k + _VLLM_IN_FLIGHT]))
            offset = 0
            for t, n in zip(params[start:stop], sizes[start:stop], strict=True):
                t.copy_(packed[offset : offset + n].view(t.dtype).view(t.shape))
                offset += n
    conn.send(digest_named(model.items()))
    if send_model:  # tests only: raw bytes, compared bit for bit by the caller
        conn.send(raw_state(model.items()))


def vllm_packing_run(
    ctx: BaselineContext,
    repeats: int = 2,
    *,
    target_bytes: int | None = None,
    send_models: bool = False,
) -> tuple[float, list[dict[str, Any]]]:
    """GB/s of vLLM-style packing, and (with ``send_models``) every receiver's final model.

    ``target_bytes`` is the bucket target (default: this engine's default buffer size, so
    both sides of the comparison use buckets of one size). Receivers' digests are checked
    against ``ctx.state`` after the last round.
    """
    import torch

    from wtcore.digest import digest_named
    from wtcore.errors import TransferTimeoutError
    from wtcore_bench.limits import median_gbps
    from wtcore_bench.received import check_digests, state_from_raw
    from wtcore_nccl.config import DEFAULT_BUFFER_SIZE

    target = target_bytes or DEFAULT_BUFFER_SIZE
    port, world, pipes, metas, procs = _start_receivers(
        ctx,
        _vllm_receiver,
        (target, ctx.device, repeats, send_models),
        lambda child: (child,),
    )
    try:
        threads = torch.get_num_threads()
        pg = _group(0, world, ctx.host, port, ctx.timeout_s)
        tensors = [t.to(ctx.device) for t in ctx.state.values()]
        buckets = vllm_buckets([t.numel() * t.element_size() for t in tensors], target)

        def run() -> None:
            in_flight: list[tuple[Any, Any]] = []
            for start, stop in buckets:
                packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors[start:stop]])
                in_flight.append((pg.broadcast(packed, 0), packed))
                if len(in_flight) >= _VLLM_IN_FLIGHT:
                    in_flight.pop(0)[0].wait()
            for work, _ in in_flight:
                work.wait()

        def answer(parent: Any, what: str) -> Any:
            if not parent.poll(ctx.timeout_s):
                raise TransferTimeoutError(
                    f"vllm_packing baseline: a receiver sent no {what} within {ctx.timeout_s}s"
                )
            return parent.recv()

        try:
            run()  # warm-up
            gbps = median_gbps(ctx.nbytes, run, repeats)
        finally:
            torch.set_num_threads(threads)
        want = digest_named(ctx.state.items())
        models: list[dict[str, Any]] = []
        for rank, (parent, _) in enumerate(pipes, start=1):
            check_digests("vllm_packing baseline", f"rank {rank}", want, answer(parent, "digests"))
            if send_models:
                models.append(state_from_raw(answer(parent, "model"), metas))
        return gbps, models
    finally:
        stop_processes(procs, 30.0)


def vllm_packing_gbps(ctx: BaselineContext) -> float:
    """The ``vllm_packing`` peer: see :func:`vllm_packing_run`."""
    return vllm_packing_run(ctx)[0]


def _start_receivers(
    ctx: BaselineContext,
    target: Callable[..., None],
    args: tuple[Any, ...],
    per_child: Callable[[Any], tuple[Any, ...]],
) -> tuple[int, int, list[Any], Spec, list[Any]]:
    """Receiver processes with a pipe each: ``target(rank, world, host, port, timeout, spec,
    *args, *per_child(pipe end))``; returns the port, world size, pipes, spec and processes."""
    from wtcore.testing.net import free_port
    from wtcore_bench.received import state_spec

    port = free_port(ctx.host)
    world = ctx.receivers + 1
    pipes = [mp.get_context("spawn").Pipe() for _ in range(ctx.receivers)]
    metas = state_spec(ctx.state)
    procs = _spawn(
        target,
        ctx.receivers,
        (world, ctx.host, port, ctx.timeout_s, metas, *args),
        per_rank=[per_child(child) for _, child in pipes],
    )
    return port, world, pipes, metas, procs


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
    """The sender hosts the rendezvous on ``host`` at a free port; every receiver joins it.

    On ``--device cuda`` the bench's receivers all share one device, and NCCL needs a GPU per
    rank, so the group is gloo over CUDA tensors (staging on the GPU); NCCL itself is covered
    by the two-GPU tests.
    """

    def init_info(
        self,
        engine: type[TrainerWeightTransferEngine],
        *,
        receivers: int,
        host: str,
        buffer_size_bytes: int | None,
        device: str = "cpu",
    ) -> TrainerInitInfo:
        from wtcore.testing.net import free_port
        from wtcore_nccl.config import DEFAULT_BUFFER_SIZE, NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            rank=0,
            master_address=host,
            master_port=free_port(host),
            world_size=receivers + 1,
            packed_buffer_size_bytes=buffer_size_bytes or DEFAULT_BUFFER_SIZE,
            device=device,
            transport="gloo",
        )


#: ``engine.nccl`` in ``wtcore.bench``.
BENCH = NCCLBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "raw_gloo": Baseline("raw gloo broadcast", raw_gloo_gbps, session=raw_gloo_session),
        "per_tensor": Baseline(
            "per-tensor broadcast + control call", per_tensor_gbps, session=per_tensor_session
        ),
        "vllm_packing": Baseline(
            "vLLM-style packing over gloo",
            vllm_packing_gbps,
            peer=True,
            devices=("cpu", "cuda"),
        ),
    },
    devices=("cpu", "cuda"),
)
