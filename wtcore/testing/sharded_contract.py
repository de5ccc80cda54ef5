"""The sharded contract suite: every engine that executes sharded plans passes it on CPU.

Subclass :class:`ShardedContractSuite` in a test module (named ``Test...``), set ``backend``
(the worker engine's name) and ``trainer_info`` (a module-level function, so that spawned
ranks can find it, returning a trainer init info for a rank, a bucket size and the number of
receivers)::

    from wtcore_kit.inline import InlineTrainerInitInfo
    from wtcore.testing.sharded_contract import ShardedContractSuite

    def inline_info(rank, buffer_size_bytes, receivers):
        return InlineTrainerInitInfo(rank=rank, packed_buffer_size_bytes=buffer_size_bytes)

    class TestInlineSharded(ShardedContractSuite):
        backend = "inline"
        trainer_info = staticmethod(inline_info)

Trainer ranks are real processes in a gloo group; rank 0 hosts the receivers (real
``WeightSyncWorker`` s holding only their TP slices, behind an ``InProcessClient``). The cases:
1->2, 2->1 (into a whole replica), 2->2, 2->3, 3->2, ``Shard(0)``, ``Shard(1)``, ``Replicate``,
a pipeline layout and a 2x2 (FSDP x TP) mesh on 4 ranks. Each checks every receiver's tensors
against the whole tensors' slices (``torch.equal``), the bytes each trainer rank packed and
sent against its planned chunks, and the bytes each receiver counted as landed against its
slice. One more case: a round in which a rank breaks (every rank fails naming it, nothing is
published, the next round is exact), then one in which a rank is killed (rank 0 fails within
the timeout naming it; the receivers keep the last round, bit for bit).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch

from wtcore.errors import TransferError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout, Replicate, Shard
from wtcore.sharded.plan import PlannedRound
from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
from wtcore.sharded.source import HeldSource, ShardedSource
from wtcore.sink import ModuleSink
from wtcore.testing.net import on_ranks
from wtcore.testing.sharded import PartsSource
from wtcore.trainer import TrainerInitInfo
from wtcore.worker import WeightSyncWorker
from wtcore_kit.inproc import InProcessClient
from wtcore_kit.synthetic import build_module

__all__ = [
    "BUFFER",
    "CASES",
    "RULES",
    "DyingParts",
    "FailingParts",
    "ShardedContractSuite",
    "expected_slices",
    "held_parts",
    "receivers",
    "run_ranks",
    "whole",
]

#: The receivers' TP rules for the suite's model.
RULES = (("*.qkv.weight", "column"), ("*.out.*", "row"), ("embed.weight", "vocab"))
SHAPES = {
    "embed.weight": (11, 6),
    "layers.0.qkv.weight": (9, 6),
    "layers.0.out.weight": (6, 7),
    "layers.0.out.bias": (6,),
    "layers.1.qkv.weight": (9, 6),
    "norm.weight": (6,),
}
#: A small bucket, so that every pair travels in several.
BUFFER = 160
#: (trainer ranks, receivers, trainer layout, whether receivers hold TP slices)
CASES = [
    (1, 2, "S0", True),
    (2, 1, "S0", False),  # FSDP into one whole replica (M -> 1), no gather anywhere
    (2, 2, "S0", True),
    (2, 3, "S1", True),
    (3, 2, "R", True),
    (2, 2, "pipe", True),
    (4, 2, "2d", True),
]


def whole() -> dict[str, torch.Tensor]:
    """The suite's model, whole (mixed dtypes, uneven sizes)."""
    g = torch.Generator().manual_seed(7)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out["layers.1.qkv.weight"] = out["layers.1.qkv.weight"].to(torch.bfloat16)
    return out


def trainer_layouts(kind: str, m: int) -> dict[str, Layout]:
    full = whole()
    if kind == "pipe":  # stage 0 holds the embedding and layer 0, stage 1 the rest
        return {
            k: Layout.whole(t.shape, owner=0 if i < 4 else 1, world_size=m)
            for i, (k, t) in enumerate(full.items())
        }
    if kind == "2d":  # FSDP x TP on a 2 x 2 mesh
        return {
            n: Layout.placed(t.shape, (2, 2), (Shard(0), Shard(t.dim() - 1)))
            for n, t in full.items()
        }
    out = {}
    for n, t in full.items():
        p: Shard | Replicate = Replicate() if kind == "R" else Shard(0)
        if kind == "S1":
            p = Shard(min(1, t.dim() - 1))  # a 1-D tensor: Shard(0)
        out[n] = Layout.placed(t.shape, (m,), (p,))
    return out


def source_for(kind: str, m: int, rank: int) -> ShardedSource:
    full = whole()
    if kind == "pipe":
        boxes = trainer_layouts(kind, m)
        mine = {k: t for k, t in full.items() if boxes[k].boxes[rank] is not None}
        return HeldSource([ParamMeta.of(k, t) for k, t in full.items()], mine)
    return PartsSource(full, trainer_layouts(kind, m), rank)


def receivers(
    n: int, tp: bool, backend: str = "inline", *, transactional: bool = False
) -> list[WeightSyncWorker]:
    """``n`` receivers of the suite's model: TP slices by :data:`RULES`, or whole replicas."""
    full = whole()
    out = []
    for r in range(n):
        lay = TPLayout(r, n, RULES) if tp else None
        held = {k: torch.zeros_like(lay.local(k, t) if lay else t) for k, t in full.items()}
        sink = ModuleSink(build_module(held), layout=lay)
        out.append(
            WeightSyncWorker(backend, sink, rank=r, world_size=n, transactional=transactional)
        )
    return out


def held_parts(w: WeightSyncWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in w.sink.module.named_parameters()}  # type: ignore[attr-defined]


def expected_slices(n: int, tp: bool) -> list[dict[str, torch.Tensor]]:
    full = whole()
    if not tp:
        return [full for _ in range(n)]
    return [{k: TPLayout(r, n, RULES).local(k, t) for k, t in full.items()} for r in range(n)]


Info = Callable[[int, int, int], TrainerInitInfo]


def _rank_main(
    rank: int,
    port: int,
    q: Any,
    info: Info,
    backend: str,
    client_cls: type[InProcessClient],
    m: int,
    n: int,
    kind: str,
    tp: bool,
    staged: bool,
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=m, timeout=datetime.timedelta(seconds=60))
    engine = None
    try:
        fleet = receivers(n, tp, backend, transactional=staged) if rank == 0 else []
        client = client_cls(fleet, timeout_s=60) if rank == 0 else None
        trainer_info = dataclasses.replace(info(rank, BUFFER, n), staged=staged)
        engine = WeightTransferTrainerFactory.trainer_init(trainer_info, client=client)
        try:
            stats = engine.send_weights(source_for(kind, m, rank), weight_version="sharded-1")
            result: dict[str, Any] = {"sent": stats.bytes_sent, "planned": stats.num_bytes}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        result["rank"] = rank
        if rank == 0:
            result["infos"] = [w.weight_info() for w in fleet]
            # compared here: tensors put on a queue may outlive the process that shares them
            want = expected_slices(n, tp)
            result["exact"] = [
                {k: torch.equal(held_parts(w)[k], t) for k, t in want[r].items()}
                for r, w in enumerate(fleet)
            ]
        q.put(result)
    finally:
        if engine is not None:
            engine.shutdown()
        for w in fleet if rank == 0 else []:
            w.shutdown()
        dist.destroy_process_group()


def run_ranks(
    info: Info,
    backend: str,
    m: int,
    n: int,
    kind: str,
    *,
    tp: bool = True,
    client_cls: type[InProcessClient] = InProcessClient,
    staged: bool = False,
) -> list[dict[str, Any]]:
    """One sharded round of the suite's model on ``m`` trainer processes into ``n``
    receivers (``staged``: a staged round into receivers that stage); each rank's result
    (``sent``, ``planned`` or ``error``; rank 0 also the receivers' ``infos`` and which of
    their tensors are ``exact``), in rank order."""
    args = (info, backend, client_cls, m, n, kind, tp, staged)
    got = on_ranks(_rank_main, m, *args, timeout_s=150)
    return sorted(got, key=lambda x: x["rank"])


class FailingParts(PartsSource):
    """A trainer rank's parts that fail while they are read (a trainer rank that breaks)."""

    def __iter__(self) -> Any:
        raise TransferError(f"trainer rank {self.rank}'s source broke")


class DyingParts(PartsSource):
    """A trainer rank's parts whose process is killed (SIGKILL) as the second part is read,
    once ``said`` (given the time) returned: a trainer rank that dies mid-round."""

    def __init__(self, *args: Any, said: Callable[[float], object]) -> None:
        super().__init__(*args)
        self.said = said

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        parts = super().__iter__()
        yield next(parts)
        self.said(time.monotonic())  # CLOCK_MONOTONIC: one clock for every process of a host
        os.kill(os.getpid(), signal.SIGKILL)


def _recovering_rank(rank: int, port: int, q: Any, info: Info, backend: str) -> None:
    """Two trainer ranks into two TP receivers: a round in which rank 1 breaks, one that must
    be whole, then one in which rank 1 is killed (what each rank saw, put on ``q``: rank 1's
    just before its kill)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    fleet = receivers(2, True, backend) if rank == 0 else []
    client = InProcessClient(fleet, timeout_s=60) if rank == 0 else None
    trainer_info = info(rank, BUFFER, 2)
    engine = WeightTransferTrainerFactory.trainer_init(trainer_info, client=client)
    out: dict[str, Any] = {"rank": rank, "timeout_s": getattr(trainer_info, "timeout_s", 60.0)}
    want = expected_slices(2, True)

    def exact() -> list[bool]:
        return [
            all(torch.equal(held_parts(w)[k], t) for k, t in want[r].items())
            for r, w in enumerate(fleet)
        ]

    def said(at: float) -> None:
        q.put({**out, "killed_at": at})
        q.close()
        q.join_thread()  # on its way before the kill

    try:
        layouts = trainer_layouts("S0", 2)
        bad = FailingParts if rank == 1 else PartsSource
        try:
            engine.send_weights(bad(whole(), layouts, rank), weight_version="broken")
        except Exception as e:
            out["first"] = f"{type(e).__name__}: {e}"
        if rank == 0:
            out["after_failure"] = [w.weight_info() for w in fleet]
        stats = engine.send_weights(PartsSource(whole(), layouts, rank), weight_version="fixed")
        out["sent"], out["planned"] = stats.bytes_sent, stats.num_bytes
        out["infos"], out["exact"] = [w.weight_info() for w in fleet], exact()
        newer = {k: t + 1 for k, t in whole().items()}
        last = DyingParts(newer, layouts, 1, said=said) if rank else PartsSource(newer, layouts, 0)
        try:
            engine.send_weights(last, weight_version="killed")
        except Exception as e:
            out["last"], out["failed_at"] = f"{type(e).__name__}: {e}", time.monotonic()
        out["after_kill"], out["exact_after_kill"] = [w.weight_info() for w in fleet], exact()
        q.put(out)
    finally:
        engine.shutdown()
        for w in fleet:
            w.shutdown()
        dist.destroy_process_group()


class ShardedContractSuite:
    """Sharded rounds every plan-executing engine must get right; see the module docstring."""

    backend: ClassVar[str] = ""
    trainer_info: ClassVar[Info]

    @pytest.mark.processes  # spawned trainer ranks: register the marker where markers are strict
    @pytest.mark.timeout(300)
    @pytest.mark.parametrize(
        ("m", "n", "kind", "tp"), CASES, ids=[f"{m}to{n}-{k}" for m, n, k, _ in CASES]
    )
    def test_each_rank_sends_its_part_and_each_receiver_gets_its_slice(
        self, m: int, n: int, kind: str, tp: bool
    ) -> None:
        got = run_ranks(type(self).trainer_info, self.backend, m, n, kind, tp=tp)
        assert all("error" not in g for g in got), got
        full = whole()
        metas = [ParamMeta.of(k, t) for k, t in full.items()]
        reports = [TPLayout(r, n, RULES) if tp else None for r in range(n)]
        dst = receiver_layouts(reports, metas)
        plan = PlannedRound.make(metas, trainer_layouts(kind, m), dst).plan
        want = expected_slices(n, tp)
        for g in got:  # what each rank packed and sent is exactly its planned chunks
            assert g["sent"] == g["planned"] == plan.nbytes(src=g["rank"]), g["rank"]
        assert sum(g["sent"] for g in got) == sum(t.nbytes for s in want for t in s.values())
        for r, (info, exact) in enumerate(zip(got[0]["infos"], got[0]["exact"], strict=True)):
            assert info["consistent"] and info["weight_version"] == "sharded-1", info
            slice_bytes = sum(t.nbytes for t in want[r].values())
            assert info["round_bytes"] == {"planned": slice_bytes, "landed": slice_bytes}, r
            assert exact == dict.fromkeys(want[r], True), r  # bit-exact, every tensor

    @pytest.mark.processes
    @pytest.mark.timeout(300)
    def test_a_rank_that_breaks_or_is_killed_fails_the_round_and_nothing_of_it_is_published(
        self,
    ) -> None:
        """Rank 1's source breaks: every rank fails naming it, and the next round is exact.
        Then rank 1 is SIGKILLed as its parts are read: rank 0 raises the round's
        ``TransferError`` naming rank 1 (not gloo's ``Connection closed by peer``, which names
        no rank) within the timeout, and the receivers keep the last round, bit for bit."""
        info = type(self).trainer_info
        got = on_ranks(_recovering_rank, 2, info, self.backend, timeout_s=200, killed=(1,))
        rank0, dead = sorted(got, key=lambda g: g["rank"])
        for g in got:  # every rank fails the round, naming the rank that broke
            assert "trainer rank 1's source broke" in g["first"], g
        for info_ in rank0["after_failure"]:  # nothing of it published
            assert info_["weight_version"] != "broken" and not info_["consistent"], info_
        for g in got:
            assert g["sent"] == g["planned"] > 0, g
        for info_ in rank0["infos"]:
            assert info_["consistent"] and info_["weight_version"] == "fixed", info_
        assert rank0["exact"] == [True, True]
        assert rank0["last"].startswith("TransferError: "), rank0["last"]
        assert "lost trainer rank 1 " in rank0["last"], rank0["last"]
        seconds = rank0["failed_at"] - dead["killed_at"]
        print(f"{self.backend}: {seconds:.3f} s from the kill to {rank0['last']!r}")
        assert 0 < seconds < rank0["timeout_s"] + 5, seconds
        for info_ in rank0["after_kill"]:  # not published; the weights are the last round's
            assert info_["weight_version"] == "fixed", info_
        assert rank0["exact_after_kill"] == [True, True]
