"""The ceiling of a two-copy shared-memory ring on this host, against single-thread memcpy.

The ipc engine moves a round with two copies: the trainer packs each tensor into a slot of a
ring in ``/dev/shm``, and the worker copies it out into its model, in another process, while
the trainer fills the next slot. With one core each, the best such a pipeline can do is the
speed of the slower copy, when the two copies do not slow each other down. This script
measures that bound with nothing else in the way: no HTTP, no JSON, no checks, no wtcore
code, two processes spinning on sequence numbers in the ring's first page. It tells how much
of the gap between the engine and memcpy is the design (two copies sharing the memory bus)
and how much is the engine.

    .venv/bin/python benchmarks/ipc_ring_ceiling.py --size-mib 1024 --slot-mib 16 --slots 4
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

#: Every spin-wait gives up after this long (a peer that died must not hang the script).
WAIT_S = 60.0


def _spin(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"ipc_ring_ceiling: gave up waiting for {what}")


def _ring(path: str, nslots: int, slot: int) -> tuple[Any, Any, Any]:
    import torch

    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 4096 + nslots * slot)
    finally:
        os.close(fd)
    ctl = torch.frombuffer(mm, dtype=torch.int64, count=3 * nslots)
    data = torch.frombuffer(mm, dtype=torch.uint8, offset=4096)
    return mm, ctl, data


def _consumer(path: str, total: int, nslots: int, slot: int, rounds: int, q: Any) -> None:
    """Copy every chunk out of the ring into a private buffer; acknowledge it."""
    import torch

    torch.set_num_threads(1)
    _, ctl, data = _ring(path, nslots, slot)
    dst = torch.ones(total, dtype=torch.uint8)  # faulted in before the first round
    q.put("ready")
    nchunks = -(-total // slot)
    for r in range(rounds):
        for f in range(nchunks):
            s, seq = f % nslots, r * nchunks + f + 1
            _spin(lambda s=s, seq=seq: int(ctl[s]) == seq, f"chunk {seq}")
            n = int(ctl[nslots + s])
            dst[f * slot : f * slot + n].copy_(data[s * slot : s * slot + n])
            ctl[2 * nslots + s] = seq
    q.put("done")  # the mapping goes with the process


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--slot-mib", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    total, slot, nslots = args.size_mib << 20, args.slot_mib << 20, args.slots
    torch.set_num_threads(1)
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    tmp = torch.empty_like(src)
    memcpy = []
    for _ in range(3):
        t0 = time.perf_counter()
        tmp.copy_(src)
        memcpy.append(time.perf_counter() - t0)
    del tmp
    path = f"/dev/shm/wtcore_ceiling_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = None
    try:
        os.posix_fallocate(fd, 0, 4096 + nslots * slot)
        os.close(fd)
        _, ctl, data = _ring(path, nslots, slot)
        data.fill_(0)  # both ends map pages that exist
        proc = ctx.Process(target=_consumer, args=(path, total, nslots, slot, args.rounds, q))
        proc.start()
        q.get(timeout=WAIT_S)
        nchunks = -(-total // slot)
        times = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for f in range(nchunks):
                s, seq = f % nslots, r * nchunks + f + 1
                if seq > nslots:
                    _spin(lambda s=s, seq=seq: int(ctl[2 * nslots + s]) >= seq - nslots, "an ack")
                n = min(slot, total - f * slot)
                data[s * slot : s * slot + n].copy_(src[f * slot : f * slot + n])
                ctl[nslots + s] = n
                ctl[s] = seq
            last = (r + 1) * nchunks
            _spin(
                lambda last=last: int(ctl[2 * nslots + (nchunks - 1) % nslots]) == last, "the end"
            )
            times.append(time.perf_counter() - t0)
        q.get(timeout=WAIT_S)
    finally:
        if proc is not None:
            proc.join(WAIT_S)
            if proc.is_alive():
                proc.kill()
        os.unlink(path)
    ring_s, copy_s = statistics.median(times), statistics.median(memcpy)
    gbs = total / 1e9
    print(
        f"{args.size_mib} MiB through {nslots} x {args.slot_mib} MiB slots: ring "
        f"{gbs / ring_s:.2f} GB/s (median of {args.rounds}), single-thread memcpy "
        f"{gbs / copy_s:.2f} GB/s (median of 3): ring / memcpy = {copy_s / ring_s:.2f}x"
    )


if __name__ == "__main__":
    main()
