"""ModuleSource over FSDP2-style DTensor shards: global metadata, full tensors on iteration.

Two real processes form a gloo group; each holds one shard of every parameter. Metadata must
report the global shape without a gather, and iterating (in lockstep on both ranks) must yield
the full tensors, bit-exact.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest

from wtcore.testing import free_port, spawned


def _rank_main(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from wtcore import ModuleSource
    from wtcore.source import iter_checked

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
        model = torch.nn.Linear(4, 6, bias=False)
        model.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        src = ModuleSource(model)
        metas = src.metadata()
        local_shape = tuple(model.weight.to_local().shape)
        gathered = [(m.name, t.clone()) for m, t in iter_checked(src)]
        results.put(
            (
                rank,
                [(m.name, m.shape) for m in metas],
                local_shape,
                [(n, torch.equal(t, full), type(t).__name__) for n, t in gathered],
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_module_source_materializes_dtensor_shards() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with spawned(_rank_main, 0, port, results), spawned(_rank_main, 1, port, results):
        got = sorted(results.get(timeout=90) for _ in range(2))
    for rank, metas, local_shape, items in got:
        assert metas == [("weight", (6, 4))], rank
        assert local_shape == (3, 4), rank
        assert items == [("weight", True, "Tensor")], rank
