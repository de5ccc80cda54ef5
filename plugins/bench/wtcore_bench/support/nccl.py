"""``wtcore bench --backend nccl``: its limit, naive loop and peer, all over gloo.

``raw_gloo`` (one preallocated buffer broadcast: the CPU path's ceiling), ``per_tensor`` (the
naive loop: a blocking control call, a broadcast into fresh memory, a copy, per tensor) and
``vllm_packing`` (a peer: vLLM's packed broadcast, rebuilt from its description).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench
from wtcore_bench.limits import median_gbps, session_gbps
from wtcore_bench.received import Spec, answer, next_message, spawned

if TYPE_CHECKING:
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = [
    "BENCH",
    "GLOO_BASELINES",
    "NCCLBench",
    "per_tensor_session",
    "raw_gloo_session",
    "vllm_buckets",
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


@contextlib.contextmanager
def _receivers(
    ctx: BaselineContext, target: Callable[..., None], *args: Any
) -> Iterator[tuple[Any, list[Any], Spec]]:
    """Receivers running ``target(rank, world, host, port, timeout_s, spec, *args, pipe)``;
    yields this end of their gloo group, the pipes and the spec."""
    import torch

    from wtcore.testing.net import free_port
    from wtcore_bench.received import state_spec

    port, world, spec = free_port(ctx.host), ctx.receivers + 1, state_spec(ctx.state)
    with spawned(target, ctx.receivers, world, ctx.host, port, ctx.timeout_s, spec, *args) as pipes:
        threads = torch.get_num_threads()
        pg = _group(0, world, ctx.host, port, ctx.timeout_s)
        torch.set_num_threads(threads)  # the caller's setting governs its own rounds
        yield pg, pipes, spec


def _raw_receiver(
    rank: int, world: int, host: str, port: int, timeout_s: float, _: Spec, nbytes: int, conn: Any
) -> None:
    import torch

    pg = _group(rank, world, host, port, timeout_s)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    count = 0
    while next_message(conn) is not None:
        pg.broadcast(buf, 0).wait()
        count += 1
    lo, hi = torch.aminmax(buf) if nbytes and count else (1, 1)
    conn.send((count, int(lo) == int(hi) == 1))


@contextlib.contextmanager
def raw_gloo_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """One preallocated buffer broadcast per call, announced over a pipe so that between calls
    no receive is posted however long the engine's rounds take."""
    import torch

    with _receivers(ctx, _raw_receiver, ctx.nbytes) as (pg, pipes, _):
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


def _naive_receiver(
    rank: int, world: int, host: str, port: int, timeout_s: float, spec: Spec, conn: Any
) -> None:
    import torch

    from wtcore.meta import dtype_from_name
    from wtcore_bench.received import zeros_from_spec

    pg = _group(rank, world, host, port, timeout_s)
    model = zeros_from_spec(spec)
    while (call := next_message(conn)) is not None:
        name, dname, shape = call
        conn.send("ok")
        fresh = torch.empty(shape, dtype=dtype_from_name(dname))
        pg.broadcast(fresh, 0).wait()
        model[name].copy_(fresh)


@contextlib.contextmanager
def per_tensor_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """The naive baseline, one round per call."""
    with _receivers(ctx, _naive_receiver) as (pg, pipes, spec):

        def run() -> None:
            for call, t in zip(spec, ctx.state.values(), strict=True):
                for parent in pipes:
                    parent.send(call)
                for parent in pipes:
                    answer(parent, ctx.timeout_s, "per_tensor baseline", "answer")
                pg.broadcast(t.contiguous(), 0).wait()

        yield run
        for parent in pipes:
            parent.send(None)


def vllm_buckets(sizes: list[int], target: int) -> list[tuple[int, int]]:
    """vLLM's bucket rule as ``[start, stop)`` index runs: deliberately not wtcore's, since the
    peer measures vLLM's schedule (a bucket closes after the tensor that overflows it)."""
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
    spec: Spec,
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
    model = zeros_from_spec(spec, device)
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
    """GB/s of vLLM-style packing (buckets of this engine's default size unless
    ``target_bytes``), and with ``send_models`` every receiver's final model."""
    import torch

    from wtcore.digest import digest_named
    from wtcore_bench.received import check_digests, state_from_raw
    from wtcore_nccl.config import DEFAULT_BUFFER_SIZE

    target = target_bytes or DEFAULT_BUFFER_SIZE
    args = (target, ctx.device, repeats, send_models)
    with _receivers(ctx, _vllm_receiver, *args) as (pg, pipes, spec):
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

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread, as the receivers
        try:
            run()  # warm-up
            gbps = median_gbps(ctx.nbytes, run, repeats)
        finally:
            torch.set_num_threads(threads)
        want = digest_named(ctx.state.items())
        models: list[dict[str, Any]] = []
        for rank, parent in enumerate(pipes, start=1):
            got = answer(parent, ctx.timeout_s, "vllm_packing baseline", "digests")
            check_digests("vllm_packing baseline", f"rank {rank}", want, got)
            if send_models:
                raw = answer(parent, ctx.timeout_s, "vllm_packing baseline", "model")
                models.append(state_from_raw(raw, spec))
        return gbps, models


def vllm_packing_gbps(ctx: BaselineContext) -> float:
    return vllm_packing_run(ctx)[0]


@dataclass(frozen=True)
class NCCLBench(EngineBench):
    """The sender hosts the rendezvous at a free port; over gloo even on ``--device cuda``
    (the receivers share one GPU, NCCL needs one per rank)."""

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


#: Shared with tcp, so both are measured against one yardstick.
GLOO_BASELINES = {
    "raw_gloo": Baseline(
        "raw gloo broadcast", partial(session_gbps, raw_gloo_session), session=raw_gloo_session
    ),
    "per_tensor": Baseline(
        "per-tensor broadcast + control call",
        partial(session_gbps, per_tensor_session, repeats=2),
        session=per_tensor_session,
    ),
}

#: ``engine.nccl`` in ``wtcore.bench``.
BENCH = NCCLBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        **GLOO_BASELINES,
        "vllm_packing": Baseline(
            "vLLM-style packing over gloo", vllm_packing_gbps, peer=True, devices=("cpu", "cuda")
        ),
    },
    devices=("cpu", "cuda"),
)
