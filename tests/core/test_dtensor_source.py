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


#: (global shape, mesh shape, placements by name): uneven splits and 2-D meshes of two ranks.
LAYOUT_CASES = [
    ((5, 3), (2,), ("S0",)),
    ((4, 5), (2,), ("S1",)),
    ((1, 3), (2,), ("S0",)),  # rank 1 holds nothing
    ((4, 3), (2,), ("R",)),
    ((5, 7), (1, 2), ("S0", "S1")),
    ((5, 7), (2, 1), ("S1", "S0")),
    ((9,), (2, 1), ("S0", "S0")),
]


def _layout_rank_main(rank: int, port: int, results: Any) -> None:
    """Each rank's DTensor local shard, against the box :class:`wtcore.layout.Layout` gives it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from wtcore import layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        got = []
        for shape, mesh_shape, names in LAYOUT_CASES:
            mesh = init_device_mesh("cpu", mesh_shape)
            torch_p = [Replicate() if p == "R" else Shard(int(p[1])) for p in names]
            ours = [layout.Replicate() if p == "R" else layout.Shard(int(p[1])) for p in names]
            full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
            local = distribute_tensor(full, mesh, torch_p).to_local()
            box = layout.Layout.placed(shape, mesh_shape, ours).boxes[rank]
            assert box is not None
            mine = full[tuple(slice(a, b) for a, b in box)]
            got.append((shape, names, tuple(local.shape), torch.equal(local, mine)))
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_layout_boxes_are_the_dtensor_local_shards() -> None:
    """Layout.placed's box for each rank is exactly the region DTensor gives that rank, uneven
    splits, empty shards and 2-D meshes included."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with spawned(_layout_rank_main, 0, port, results), spawned(_layout_rank_main, 1, port, results):
        got = sorted(results.get(timeout=90) for _ in range(2))
    for rank, cases in got:
        assert len(cases) == len(LAYOUT_CASES), rank
        for shape, names, local_shape, equal in cases:
            assert equal, (rank, shape, names, local_shape)
