"""What framing costs a gloo broadcast on this host: one message, many, and many with headers.

The nccl engine (gloo on CPU) sends a round as one broadcast per bucket, and before each a
32-byte header broadcast that the receiver must have (and check) before it posts the bucket's
receive: that is what keeps a sender whose bytes disagree with the plan from aborting the
receiving process. This script measures, between two processes on loopback with nothing else
in the way (no wtcore code, no HTTP, no copies), the ceiling of each shape of the same bytes:

* ``1 message``: one broadcast of the whole payload (the bench's raw gloo limit);
* ``N messages``: the payload in ``N`` equal broadcasts, ``--inflight`` of them in flight;
* ``N messages + headers``: the same, each preceded by a header the receiver waits for
  before posting the message's receive (the engine's framing until 0.3);
* ``N messages + one table``: the same, after one header and one table of every message's
  size, which the receiver waits for once before it posts any receive (the framing since).

    .venv/bin/python benchmarks/gloo_frames_ceiling.py --size-mib 1024 --messages 300
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

#: Every collective of this script gives up after this long (a dead peer must not hang it).
TIMEOUT_S = 120.0


def _group(rank: int, port: int) -> Any:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=TIMEOUT_S)
    )
    torch.set_num_threads(1)
    return dist.ProcessGroupGloo(
        dist.PrefixStore("frames", store),  # type: ignore[attr-defined]
        rank,
        2,
        timedelta(seconds=TIMEOUT_S),
    )


def _one_pass(pg: Any, bufs: list[Any], framing: str, inflight: int, sender: bool) -> None:
    """Broadcast ``bufs`` in order, ``inflight`` in flight. ``framing``: ``"headers"``, a
    header before each, which the receiver waits for before it posts the message's receive;
    ``"table"``, one header and one table of sizes first, which the receiver waits for once."""
    import torch

    headers = framing == "headers"
    works: list[Any] = []
    if framing == "table":
        for words in (4, 2 * len(bufs)):
            w = pg.broadcast(torch.zeros(words, dtype=torch.int64), 0)
            if sender:
                works.append(w)
            else:
                w.wait()
    for b in bufs:
        if headers:
            header = torch.zeros(4, dtype=torch.int64)
            if sender:
                works.append(pg.broadcast(header, 0))
            else:
                pg.broadcast(header, 0).wait()
        works.append(pg.broadcast(b, 0))
        while len(works) > inflight * (2 if headers and sender else 1):
            works.pop(0).wait()
    for w in works:
        w.wait()


def _shapes(messages: int) -> list[tuple[str, int, str]]:
    return [
        ("1 message", 1, "none"),
        (f"{messages} messages", messages, "none"),
        (f"{messages} messages + headers", messages, "headers"),
        (f"{messages} messages + one table", messages, "table"),
    ]


def _receiver(port: int, nbytes: int, messages: int, inflight: int, repeats: int) -> None:
    import torch

    pg = _group(1, port)
    for _, n, framing in _shapes(messages):
        bufs = list(torch.empty(nbytes, dtype=torch.uint8).split(-(-nbytes // n)))
        for _ in range(repeats + 1):
            _one_pass(pg, bufs, framing, inflight, sender=False)


def main() -> None:
    import torch

    from wtcore.testing.net import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    nbytes = a.size_mib << 20
    port = free_port("127.0.0.1")
    args = (port, nbytes, a.messages, a.inflight, a.repeats)
    child = mp.get_context("spawn").Process(target=_receiver, args=args, daemon=True)
    child.start()
    try:
        pg = _group(0, port)
        print(f"{a.size_mib} MiB, {a.inflight} in flight, median of {a.repeats} passes")
        for label, n, framing in _shapes(a.messages):
            bufs = list(torch.ones(nbytes, dtype=torch.uint8).split(-(-nbytes // n)))
            _one_pass(pg, bufs, framing, a.inflight, sender=True)  # warm-up
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                _one_pass(pg, bufs, framing, a.inflight, sender=True)
                times.append(time.perf_counter() - t0)
            print(f"  {label:32s} {nbytes / statistics.median(times) / 1e9:6.2f} GB/s", flush=True)
        child.join(TIMEOUT_S)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


if __name__ == "__main__":
    main()
