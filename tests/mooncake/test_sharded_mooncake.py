"""Sharded rounds on the mooncake engine: every receiver reads its chunks straight out of the
trainer ranks' own parts (real transfer engines over TCP, real trainer processes in a gloo
group, real receivers holding TP slices).

Also here: a receiver refuses a forged ``senders`` update naming the entry before it reads a
byte, and the byte runs a region is read in.
"""

from __future__ import annotations

import pytest
import torch

from wtcore.errors import PayloadError
from wtcore.layout import Layout, Shard
from wtcore.meta import ParamMeta
from wtcore.plan import PlannedRound
from wtcore.testing.sharded_contract import ShardedContractSuite
from wtcore_mooncake import MooncakeTrainerInitInfo
from wtcore_mooncake.pairs import SendersUpdate, byte_runs

pytest.importorskip("mooncake.engine", reason="Mooncake is not installed")


def mooncake_info(rank: int, buffer_size_bytes: int, receivers: int) -> MooncakeTrainerInitInfo:
    return MooncakeTrainerInitInfo(
        packed_buffer_size_bytes=buffer_size_bytes, timeout_s=60.0, rank=rank
    )


class TestMooncakeSharded(ShardedContractSuite):
    backend = "mooncake"
    trainer_info = staticmethod(mooncake_info)


@pytest.mark.parametrize(
    ("box", "runs"),
    [
        (((1, 3), (0, 5)), [(20, 40)]),  # whole rows: one run
        (((0, 4), (0, 5)), [(0, 80)]),  # the whole tensor
        (((1, 3), (2, 4)), [(28, 8), (48, 8)]),  # a column block: one run per row
        (((0, 0), (0, 5)), []),  # empty
    ],
)
def test_a_region_is_read_in_runs_of_the_contiguous_part(box: tuple, runs: list) -> None:
    assert byte_runs((4, 5), box, 4) == runs
    t = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    raw = t.view(torch.uint8).flatten()
    got = torch.cat([raw[o : o + n] for o, n in runs]) if runs else raw[:0]
    want = t[box[0][0] : box[0][1], box[1][0] : box[1][1]].contiguous().view(torch.uint8).flatten()
    assert torch.equal(got, want)


def _planned() -> PlannedRound:
    metas = [ParamMeta("w", torch.float32, (4, 6)), ParamMeta("b", torch.float32, (6,))]
    src = {m.name: Layout.placed(m.shape, (2,), (Shard(0),)) for m in metas}
    dst = {m.name: Layout.whole(m.shape) for m in metas}
    return PlannedRound.make(metas, src, dst)


GOOD = {"endpoint": "127.0.0.1:4000", "tensors": {"w": [4096, 48], "b": [8192, 12]}}


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([GOOD], "the plan has 2 trainer ranks, got 1 entries"),
        ([GOOD, {**GOOD, "endpoint": "nohost"}], r"senders\[1\]\.endpoint"),
        ([GOOD, {**GOOD, "extra": 1}], r"senders\[1\]: expected an object"),
        ([GOOD, {**GOOD, "tensors": {"w": [4096, 48]}}], r"senders\[1\]\.tensors: expected"),
        ([GOOD, {**GOOD, "tensors": {**GOOD["tensors"], "x": [1, 1]}}], r"senders\[1\]\.tensors"),
        ([GOOD, {**GOOD, "tensors": {"w": [4096, 4800], "b": [8192, 12]}}], r"\['w'\]"),
        ([GOOD, {**GOOD, "tensors": {"w": [0, 48], "b": [8192, 12]}}], r"\['w'\]"),
        ([GOOD, {**GOOD, "tensors": {"w": [-5, 48], "b": [8192, 12]}}], r"\['w'\]"),
        ([GOOD, {**GOOD, "tensors": {"w": [True, 48], "b": [8192, 12]}}], r"\['w'\]"),
        ([GOOD, {**GOOD, "tensors": {"w": "4096", "b": [8192, 12]}}], r"\['w'\]"),
    ],
)
def test_a_forged_senders_update_is_refused_naming_the_entry(entries: list, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        SendersUpdate(entries).checked(_planned(), [0, 1])


def test_a_good_senders_update_gives_each_rank_its_endpoint_and_addresses() -> None:
    got = SendersUpdate([GOOD, GOOD]).checked(_planned(), [0, 1])
    assert got == {r: ("127.0.0.1:4000", {"w": 4096, "b": 8192}) for r in (0, 1)}
