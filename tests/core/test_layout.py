"""Layouts: each rank's box of a tensor, from placements, TP rules and the wire (checked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.sharded.layout import Layout, Replicate, Shard, split, tp_layout, volume


@pytest.mark.parametrize(("n", "k"), [(6, 2), (5, 2), (5, 3), (5, 4), (2, 3), (0, 2), (7, 1)])
def test_split_follows_torch_chunk_padded_with_empty_parts(n: int, k: int) -> None:
    chunks = torch.arange(n).chunk(k) if n else ()
    want = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
    got = [split(n, k, i) for i in range(k)]
    assert [g for g in got if g[0] < g[1]] == want
    assert all(a == b == n for a, b in got[len(want) :])  # the rest hold nothing
    assert sum(b - a for a, b in got) == n


def test_whole_is_one_rank_holding_everything() -> None:
    lay = Layout.whole((4, 3))
    assert lay.boxes == (((0, 4), (0, 3)),) and lay.world_size == 1
    owned = Layout.whole((4, 3), owner=2, world_size=3)  # a pipeline stage's tensor
    assert owned.boxes == (None, None, ((0, 4), (0, 3)))
    assert owned.local_shape(0) == (0, 0) and owned.local_shape(2) == (4, 3)


def test_placements_on_one_and_two_dimensional_meshes() -> None:
    assert Layout.placed((5, 4), (2,), (Shard(0),)).boxes == (
        ((0, 3), (0, 4)),
        ((3, 5), (0, 4)),
    )
    assert Layout.placed((5, 4), (2,), (Shard(1),)).boxes == (
        ((0, 5), (0, 2)),
        ((0, 5), (2, 4)),
    )
    assert Layout.placed((5, 4), (3,), (Replicate(),)).boxes == (((0, 5), (0, 4)),) * 3
    # 2 x 2: rows over the first mesh dimension, columns over the second, row-major ranks
    grid = Layout.placed((4, 6), (2, 2), (Shard(0), Shard(1)))
    assert grid.boxes == (
        ((0, 2), (0, 3)),
        ((0, 2), (3, 6)),
        ((2, 4), (0, 3)),
        ((2, 4), (3, 6)),
    )
    # HSDP: replicated over the first mesh dimension, sharded over the second
    hsdp = Layout.placed((4, 6), (2, 2), (Replicate(), Shard(0)))
    assert hsdp.boxes[0] == hsdp.boxes[2] == ((0, 2), (0, 6))
    # the same tensor dimension sharded twice: split, then split again (torch's order)
    twice = Layout.placed((8,), (2, 2), (Shard(0), Shard(0)))
    assert twice.boxes == (((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),))


def test_a_placement_that_does_not_fit_is_refused() -> None:
    with pytest.raises(PayloadError, match="placements: 1 for a mesh of 2 dimensions"):
        Layout.placed((4,), (2, 2), (Shard(0),))
    with pytest.raises(PayloadError, match=r"placements: Shard\(1\) of a 1-D tensor"):
        Layout.placed((4,), (2,), (Shard(1),))


def test_tp_rules_of_vllm_layers() -> None:
    assert tp_layout((6, 4), "column", 2).boxes == (((0, 3), (0, 4)), ((3, 6), (0, 4)))
    assert tp_layout((6, 4), "row", 2).boxes == (((0, 6), (0, 2)), ((0, 6), (2, 4)))
    assert tp_layout((6,), "row", 2).boxes == (((0, 6),),) * 2  # a row layer's bias
    assert tp_layout((6,), "column", 2).boxes == (((0, 3),), ((3, 6),))
    assert tp_layout((11, 4), "vocab", 2).boxes == (((0, 6), (0, 4)), ((6, 11), (0, 4)))
    assert tp_layout((3, 4), "replicated", 4).world_size == 4
    with pytest.raises(PayloadError, match="kind: expected one of"):
        tp_layout((6, 4), "diagonal", 2)
    with pytest.raises(PayloadError, match="tp_size: expected 1 to"):
        tp_layout((6, 4), "row", 0)


def test_the_wire_round_trips() -> None:
    for lay in (
        Layout.whole((4, 3)),
        Layout.whole((4, 3), owner=1, world_size=2),
        Layout.placed((5, 4), (2, 2), (Shard(0), Shard(1))),
        Layout.whole(()),
    ):
        assert Layout.from_wire(lay.to_wire()) == lay
    assert volume(((0, 5), (2, 4))) == 10


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([1], "layouts.w: expected an object, got list"),
        ({"shape": "4", "boxes": [None]}, "layouts.w.shape: expected a list of at most 8"),
        ({"shape": [1] * 9, "boxes": [None]}, "layouts.w.shape: expected a list of at most 8"),
        ({"shape": [4, -1], "boxes": [None]}, r"layouts.w.shape\[1\]: expected a size"),
        ({"shape": [4, True], "boxes": [None]}, r"layouts.w.shape\[1\]: expected a size"),
        ({"shape": [1 << 30, 1 << 30], "boxes": [None]}, "layouts.w.shape: more than"),
        ({"shape": [4], "boxes": []}, "layouts.w.boxes: expected a list of 1 to 65536"),
        ({"shape": [4], "boxes": [[[0, 4], [0, 1]]]}, r"boxes\[0\]: expected 1 \[start, stop\]"),
        (
            {"shape": [4], "boxes": [None, [[0, 5]]]},
            r"boxes\[1\]\[0\]: expected \[start, stop\] within 0..4",
        ),
        ({"shape": [4], "boxes": [[[3, 2]]]}, r"boxes\[0\]\[0\]: expected \[start, stop\]"),
        ({"shape": [4], "boxes": [[[-1, 2]]]}, r"boxes\[0\]\[0\]: expected \[start, stop\]"),
        ({"shape": [4], "boxes": [[["0", 2]]]}, r"boxes\[0\]\[0\]: expected \[start, stop\]"),
        ({"shape": [4], "boxes": [[[0, 2, 3]]]}, r"boxes\[0\]\[0\]: expected \[start, stop\]"),
    ],
)
def test_a_hostile_layout_is_refused_naming_the_field(data: Any, fragment: str) -> None:
    with pytest.raises(PayloadError, match=fragment):
        Layout.from_wire(data, field="layouts.w")
