"""The limits and naive baselines that the bench measures in the same run.

Absolute numbers on shared machines are noise; ratios taken in one run are not. So every
figure the bench prints for an engine is set against, measured just before it:

* ``memcpy``: one single-threaded copy into a preallocated buffer (the practical ceiling);
* ``raw_gloo``: one preallocated buffer of the model's size broadcast over plain gloo (the
  ceiling of the nccl engine's CPU path);
* ``shm_copy``: one copy out of a POSIX shared-memory segment that already holds the weights
  (the ceiling of the ipc engine's CPU path);
* ``per_tensor``: the naive loop users still run: for every tensor a blocking control call,
  then a broadcast into freshly allocated memory, then a copy into the model;
* ``file``: ``torch.save`` to a file, ``torch.load``, copy into the model.

Each returns GB/s (1e9 bytes per second of wall time, median of ``repeats``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from wtcore.procs import stop_processes

if TYPE_CHECKING:
    import torch

__all__ = ["file_gbps", "memcpy_gbps", "per_tensor_gbps", "raw_gloo_gbps", "shm_copy_gbps"]

_TIMEOUT_S = 300.0


def _median_gbps(nbytes: int, run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_gbps(nbytes, lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(threads)


def shm_copy_gbps(nbytes: int, repeats: int = 3) -> float:
    import mmap

    fd, path = tempfile.mkstemp(prefix="wtcore-bench-", dir="/dev/shm")
    try:
        os.ftruncate(fd, max(nbytes, 1))
        with mmap.mmap(fd, max(nbytes, 1)) as mm:
            return _copy_out_gbps(mm, nbytes, repeats)
    finally:
        os.close(fd)
        os.unlink(path)


def _copy_out_gbps(mm: Any, nbytes: int, repeats: int) -> float:
    """Time copies out of ``mm``; every view of it is gone when this returns (so it can close)."""
    import numpy as np
    import torch

    seg = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes))
    seg.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(seg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_gbps(nbytes, lambda: dst.copy_(seg), repeats)
    finally:
        torch.set_num_threads(threads)


def file_gbps(state: Mapping[str, torch.Tensor], repeats: int = 2) -> float:
    import torch

    from wtcore.testing.sources import zeros_like_state

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    model = zeros_like_state(state)
    with tempfile.TemporaryDirectory(prefix="wtcore-bench-") as d:
        path = os.path.join(d, "weights.pt")

        def run() -> None:
            torch.save(dict(state), path)
            loaded = torch.load(path, weights_only=True)  # tensors only: never unpickle code
            for name, t in model.items():
                t.copy_(loaded[name])

        return _median_gbps(nbytes, run, repeats)


# ---------------------------------------------------------------------- gloo helpers
def _group(rank: int, world: int, port: int) -> Any:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=_TIMEOUT_S)
    )
    torch.set_num_threads(1)
    return dist.ProcessGroupGloo(
        dist.PrefixStore("wtcore-bench", store),  # type: ignore[attr-defined]
        rank,
        world,
        timedelta(seconds=_TIMEOUT_S),
    )


def _raw_receiver(rank: int, world: int, port: int, nbytes: int, repeats: int) -> None:
    import torch

    pg = _group(rank, world, port)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        pg.broadcast(buf, 0).wait()


def raw_gloo_gbps(nbytes: int, receivers: int, repeats: int = 3) -> float:
    """One preallocated buffer broadcast from this process to ``receivers`` processes."""
    import torch

    from wtcore.testing.net import free_port

    port = free_port()
    world = receivers + 1
    procs = _spawn(_raw_receiver, receivers, world, port, nbytes, repeats)
    try:
        threads = torch.get_num_threads()
        pg = _group(0, world, port)
        try:
            buf = torch.ones(nbytes, dtype=torch.uint8)
            pg.broadcast(buf, 0).wait()  # warm-up
            return _median_gbps(nbytes, lambda: pg.broadcast(buf, 0).wait(), repeats)
        finally:
            torch.set_num_threads(threads)
    finally:
        stop_processes(procs, 30.0)


def _naive_receiver(
    rank: int,
    world: int,
    port: int,
    metas: list[tuple[str, str, list[int]]],
    conn: Any,
    repeats: int,
) -> None:
    import torch

    from wtcore.meta import dtype_from_name

    pg = _group(rank, world, port)
    model = {n: torch.zeros(s, dtype=dtype_from_name(d)) for n, d, s in metas}
    for _ in range(repeats + 1):
        for _name in model:
            name, dname, shape = conn.recv()  # the control call for this tensor
            conn.send("ok")
            fresh = torch.empty(shape, dtype=dtype_from_name(dname))
            pg.broadcast(fresh, 0).wait()
            model[name].copy_(fresh)


def per_tensor_gbps(state: Mapping[str, torch.Tensor], receivers: int, repeats: int = 2) -> float:
    """The naive baseline: a blocking control call and a fresh broadcast per tensor."""
    import torch

    from wtcore.meta import dtype_name
    from wtcore.testing.net import free_port

    port = free_port()
    world = receivers + 1
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(receivers)]
    metas = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in state.items()]
    procs = []
    for i in range(receivers):
        p = ctx.Process(
            target=_naive_receiver,
            args=(i + 1, world, port, metas, pipes[i][1], repeats),
            daemon=True,
        )
        p.start()
        procs.append(p)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    try:
        threads = torch.get_num_threads()
        pg = _group(0, world, port)

        def run() -> None:
            for (name, dname, shape), t in zip(metas, state.values(), strict=True):
                for parent, _ in pipes:
                    parent.send((name, dname, shape))
                for parent, _ in pipes:
                    if not parent.poll(_TIMEOUT_S):
                        raise TimeoutError("naive baseline: a receiver stopped answering")
                    parent.recv()
                pg.broadcast(t.contiguous(), 0).wait()

        try:
            run()  # warm-up
            return _median_gbps(nbytes, run, repeats)
        finally:
            torch.set_num_threads(threads)
    finally:
        stop_processes(procs, 30.0)


def _spawn(target: Callable[..., None], receivers: int, *args: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    world = args[0]
    procs = []
    for i in range(receivers):
        p = ctx.Process(target=target, args=(i + 1, world, *args[1:]), daemon=True)
        p.start()
        procs.append(p)
    return procs
