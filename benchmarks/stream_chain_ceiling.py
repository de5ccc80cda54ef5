"""What tcp's chain can do with nothing around its streams: the `make demo` ceiling.

``make demo`` sends a model of 300 tensors from a trainer through a chain of two receivers
(trainer -> rank 1 -> rank 2, TCP streams, the first receiver relaying). This script runs the
same chain (``wtcore_tcp.chain``, three processes on loopback) with nothing
around it: no control plane, no plan, no packing, no sink. Every tensor is one message, sent
straight from the trainer's tensor and received straight into the receivers' tensors. It prints
each process's median wall time a round and its CPU time (user and system) a round, and checks
every receiver bit for bit at the end. Against the engine's own round (``wtcore bench``), the
difference is what the engine costs around its transport.

    .venv/bin/python benchmarks/stream_chain_ceiling.py --size-mib 256 --tensors 300 --rounds 12
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from datetime import timedelta
from typing import Any

from wtcore_channel.listen import listen_on

#: Every wait of this script gives up after this long (a dead peer must not hang it).
TIMEOUT_S = 120.0


def _run(rank: int, args: argparse.Namespace, port: int, barrier: Any, out: Any) -> None:
    import torch

    from wtcore_kit.synthetic import synthetic_state
    from wtcore_tcp.chain import accept_chain, connect_chain

    torch.set_num_threads(1)
    state = synthetic_state(args.size_mib << 20, args.tensors, "bfloat16", 0)
    tensors = list(state.values()) if rank == 0 else [torch.zeros_like(t) for t in state.values()]
    chain = {"world_size": 3, "token": "c" * 32, "timeout_s": TIMEOUT_S}
    if rank == 0:  # the sender listens before anyone connects
        with listen_on("127.0.0.1", port, "the chain's sender", field="") as listener:
            barrier.wait(TIMEOUT_S)
            stream = accept_chain(listener, **chain)
    else:
        barrier.wait(TIMEOUT_S)
        stream = connect_chain("127.0.0.1", port, rank=rank, **chain)
    rows = []
    try:
        for _ in range(args.rounds):
            barrier.wait(TIMEOUT_S)
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            works = [stream.broadcast(t) for t in tensors]
            for w in works:
                if not w.wait(timedelta(seconds=TIMEOUT_S)) or w.error is not None:
                    raise RuntimeError(f"rank {rank}: {w.error or 'timed out'}")
            barrier.wait(TIMEOUT_S)  # the round ends when every rank has it
            after = resource.getrusage(resource.RUSAGE_SELF)
            rows.append(
                (
                    time.perf_counter() - t0,
                    after.ru_utime - before.ru_utime,
                    after.ru_stime - before.ru_stime,
                )
            )
    finally:
        stream.close()
    exact = all(torch.equal(a, b) for a, b in zip(tensors, state.values(), strict=True))
    out.put((rank, rows, exact))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    from wtcore.testing.net import free_port

    ctx = mp.get_context("spawn")
    port, barrier, out = free_port(), ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, args, port, barrier, out)) for r in range(3)]
    for proc in procs:
        proc.start()
    try:
        results = sorted(out.get(timeout=TIMEOUT_S * (args.rounds + 2)) for _ in procs)
    finally:
        for proc in procs:
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
    warm = slice(2, None) if args.rounds > 3 else slice(None)  # the first rounds touch fresh pages
    cpu = 0.0
    for rank, rows, exact in results:
        wall = statistics.median(r[0] for r in rows[warm])
        user = statistics.mean(r[1] for r in rows[warm])
        system = statistics.mean(r[2] for r in rows[warm])
        cpu += user + system
        role = ("the trainer", "the relay", "the last receiver")[rank]
        print(
            f"rank {rank} ({role}): {wall:.3f} s a round, CPU {user:.3f} s user + "
            f"{system:.3f} s system" + ("" if rank == 0 else f", bit-exact: {exact}")
        )
    print(f"CPU of the three processes: {cpu:.3f} s a round")


if __name__ == "__main__":
    main()
