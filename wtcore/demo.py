"""``wtcore demo``: a synthetic model synced in-process, verified bit for bit.

The trainer and its receivers live in this process and talk through
:class:`~wtcore.inproc.InProcessClient`, so the demo runs anywhere with no servers. Each round
changes the weights, syncs them, and compares per-tensor digests computed on both sides.
"""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["run_demo"]


def run_demo(
    *,
    backend: str = "local",
    size_bytes: int = 64 << 20,
    num_tensors: int = 100,
    dtype: str = "bfloat16",
    rounds: int = 3,
    receivers: int = 2,
    out: TextIO,
) -> int:
    """Run the demo; returns the process exit code (1 if any receiver mismatched)."""
    import torch

    from wtcore.digest import digest_named
    from wtcore.factory import WeightTransferTrainerFactory
    from wtcore.inproc import InProcessClient
    from wtcore.local import LocalTrainerInitInfo
    from wtcore.sink import ModuleSink
    from wtcore.source import ModuleSource
    from wtcore.testing.sources import build_module, synthetic_state, zeros_like_state
    from wtcore.worker import WeightSyncWorker

    if backend != "local":
        out.write("wtcore demo runs the in-process 'local' engine; see `wtcore bench` for others\n")
        return 2
    state = synthetic_state(size_bytes, num_tensors, dtype, seed=0)
    trainer_model = build_module(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out.write(
        f"wtcore demo: {len(state)} tensors, {nbytes / 2**20:.1f} MiB {dtype}, "
        f"{receivers} receiver(s), backend {backend!r}\n"
    )
    models = [build_module(zeros_like_state(state)) for _ in range(receivers)]
    workers = [
        WeightSyncWorker(backend, ModuleSink(m), rank=i, world_size=receivers)
        for i, m in enumerate(models)
    ]
    client = InProcessClient(workers)
    engine = WeightTransferTrainerFactory.trainer_init(
        LocalTrainerInitInfo(rank=0), client=client, source=ModuleSource(trainer_model)
    )
    failed = False
    try:
        for step in range(rounds):
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(0.5)
            t0 = time.perf_counter()
            stats = engine.send_weights(weight_version=f"step-{step}")
            elapsed = time.perf_counter() - t0
            want = digest_named(trainer_model.named_parameters())
            ok = [w.checksums() == want for w in workers]
            versions = {w.weight_info()["weight_version"] for w in workers}
            out.write(
                f"  round {step}: {elapsed * 1e3:7.1f} ms  {stats.gbps:6.2f} GB/s  "
                f"{stats.num_buckets} buckets  version {sorted(map(str, versions))}  "
                f"verified {sum(ok)}/{len(ok)}\n"
            )
            failed |= not all(ok)
    finally:
        engine.shutdown()
        for w in workers:
            w.shutdown()
    out.write("FAILED: a receiver does not match the trainer\n" if failed else "OK: bit-exact\n")
    return 1 if failed else 0
