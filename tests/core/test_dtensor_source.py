"""ModuleSource over FSDP2-style DTensor shards: global metadata, full tensors on iteration.

Two real processes form a gloo group; each holds one shard of every parameter. Metadata must
report the global shape without a gather, and iterating (in lockstep on both ranks) must yield
the full tensors, bit-exact.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from wtcore.testing import on_ranks

pytestmark = pytest.mark.processes


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
    got = sorted(on_ranks(_rank_main, 2))
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
    """Each rank's DTensor local shard, against the box :class:`wtcore.sharded.layout.Layout` gives it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from wtcore.sharded import layout

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
    got = sorted(on_ranks(_layout_rank_main, 2))
    for rank, cases in got:
        assert len(cases) == len(LAYOUT_CASES), rank
        for shape, names, local_shape, equal in cases:
            assert equal, (rank, shape, names, local_shape)


def _sharded_rank_main(rank: int, port: int, results: Any) -> None:
    """ShardedModuleSource on a rank of a 2-rank mesh: local shards only, never a gather."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from wtcore.sharded import ShardedModuleSource
    from wtcore.sharded.layout import tp_layout
    from wtcore.sharded.plan import plan_transfer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full_w = torch.arange(35, dtype=torch.float32).reshape(7, 5)  # uneven: 4 + 3 rows
        full_v = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
        model.v = torch.nn.Parameter(distribute_tensor(full_v, mesh, [Shard(1)]))
        model.register_buffer("scale", torch.tensor([2.0, 3.0]))

        def no_gather(self: Any) -> Any:
            raise AssertionError("full_tensor() was called")

        DTensor.full_tensor = no_gather  # type: ignore[method-assign]
        src = ShardedModuleSource(model, include_buffers=True)
        metas = src.metadata()
        layouts = src.layouts()
        fulls = {"w": full_w, "v": full_v, "scale": torch.tensor([2.0, 3.0])}
        parts_ok = []
        for name, t in src:
            box = layouts[name].boxes[src.rank]
            assert box is not None
            parts_ok.append((name, torch.equal(t, fulls[name][tuple(slice(a, b) for a, b in box)])))
        # M -> 1 (a TP=1 receiver, replicated) and M -> 2 (a TP=2 receiver, row split)
        one = plan_transfer(
            [(m, layouts[m.name], tp_layout(m.shape, "replicated", 1)) for m in metas]
        )
        two = plan_transfer([(m, layouts[m.name], tp_layout(m.shape, "row", 2)) for m in metas])
        mine = sum(t.numel() * t.element_size() for _, t in src)
        results.put(
            (
                rank,
                [(m.name, m.shape) for m in metas],
                parts_ok,
                one.digest(),
                two.digest(),
                one.nbytes(src=rank),
                mine,
                one.nbytes(),
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_sharded_module_source_yields_local_shards_and_plans_alike_on_every_rank() -> None:
    """Each rank yields its own shards (never full_tensor()), bit-exact against its box; both
    ranks compute the same plans; into one replicated receiver (M -> 1) each rank sends its
    shards, and the replicated buffer is sent once in all."""
    got = sorted(on_ranks(_sharded_rank_main, 2))
    (
        (_, metas0, parts0, one0, two0, sent0, mine0, total),
        (_, metas1, parts1, one1, two1, sent1, mine1, _),
    ) = got
    assert metas0 == metas1 == [("w", (7, 5)), ("v", (3, 4)), ("scale", (2,))]  # global shapes
    assert all(ok for _, ok in parts0 + parts1), (parts0, parts1)
    assert one0 == one1 and two0 == two1 and one0 != two0  # the same plans on both ranks
    # every element once: 35 + 12 + 2 floats into the one receiver
    assert total == (35 + 12 + 2) * 4 == sent0 + sent1
    # a rank sends its shards; the buffer, held by both, comes from one of them only
    shards = {0: (4 * 5 + 3 * 2) * 4, 1: (3 * 5 + 3 * 2) * 4}
    assert {sent0 - shards[0], sent1 - shards[1]} == {0, 8}
    assert (mine0, mine1) == (shards[0] + 8, shards[1] + 8)
