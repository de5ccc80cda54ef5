"""A receiver reports how it is sharded; the trainer reads it and plans only its slices.

The report (:class:`wtcore.sharded.receiver_layout.TPLayout`) is vLLM's TP rules in a few bytes. It is
checked like anything from a peer (each bad field refused by name), it reaches the trainer
through ``weight_info()`` over real HTTP servers, and the plan built from it sends each
receiver exactly its slices: executed by the reference executor, then delivered in a real
round (the inline engine, one entry per receiver) into modules that hold only their slices,
bit-exact against the whole tensors.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Layout, Shard
from wtcore.sharded.plan import plan_transfer
from wtcore.sharded.receiver_layout import MAX_RULES, TPLayout, receiver_layouts
from wtcore.testing.sharded import execute_plan, part
from wtcore_kit.synthetic import build_module

#: A tiny transformer layer's names and vLLM's split of each (the first rule that matches).
RULES = (
    ("*.qkv_proj.weight", "column"),
    ("*.o_proj.*", "row"),
    ("embed_tokens.weight", "vocab"),
)
SHAPES = {
    "embed_tokens.weight": (11, 4),  # 11 rows: uneven over 2 and 3 ranks
    "layers.0.qkv_proj.weight": (7, 4),
    "layers.0.o_proj.weight": (4, 5),
    "layers.0.o_proj.bias": (4,),  # a row layer's bias is whole on every rank
    "norm.weight": (4,),  # no rule: replicated
}


def whole() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: torch.randn(s) for n, s in SHAPES.items()}


def test_rules_give_vllm_layouts_first_match_wins() -> None:
    lay = TPLayout(1, 2, RULES)
    assert lay.kind("layers.0.qkv_proj.weight") == "column"
    assert lay.kind("layers.0.o_proj.bias") == "row"
    assert lay.kind("norm.weight") == "replicated"
    assert lay.box("layers.0.qkv_proj.weight", (7, 4)) == ((4, 7), (0, 4))
    assert lay.box("layers.0.o_proj.weight", (4, 5)) == ((0, 4), (3, 5))
    assert lay.box("layers.0.o_proj.bias", (4,)) == ((0, 4),)
    assert lay.box("embed_tokens.weight", (11, 4)) == ((6, 11), (0, 4))
    first = TPLayout(0, 2, (("a.*", "row"), ("a.w", "column")))
    assert first.kind("a.w") == "row"
    assert TPLayout(0, 2, default="column").kind("x") == "column"
    full = torch.arange(28.0).reshape(7, 4)
    assert torch.equal(lay.local("layers.0.qkv_proj.weight", full), full[4:7])


def test_the_wire_form_round_trips() -> None:
    lay = TPLayout(2, 3, RULES, default="replicated")
    assert TPLayout.from_wire(lay.to_wire()) == lay


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ("x", "layout: expected an object"),
        ({"tp_rank": 0, "tp_size": 0}, "layout.tp_size"),
        ({"tp_rank": 2, "tp_size": 2}, "layout.tp_rank"),
        ({"tp_rank": True, "tp_size": 2}, "layout.tp_rank"),
        ({"tp_rank": 0, "tp_size": 1 << 17}, "layout.tp_size"),
        ({"tp_rank": 0, "tp_size": 2, "rules": {}}, "layout.rules"),
        ({"tp_rank": 0, "tp_size": 2, "rules": [["a"]]}, "layout.rules[0]"),
        ({"tp_rank": 0, "tp_size": 2, "rules": [["a", "diagonal"]]}, "layout.rules[0]"),
        ({"tp_rank": 0, "tp_size": 2, "rules": [[7, "row"]]}, "layout.rules[0]"),
        ({"tp_rank": 0, "tp_size": 2, "rules": [["", "row"]]}, "layout.rules[0]"),
        ({"tp_rank": 0, "tp_size": 2, "rules": [["x" * 257, "row"]]}, "layout.rules[0]"),
        ({"tp_rank": 0, "tp_size": 2, "rules": [["a", "row"]] * (MAX_RULES + 1)}, "layout.rules"),
        ({"tp_rank": 0, "tp_size": 2, "default": "sideways"}, "layout.default"),
        ({"tp_rank": 0, "tp_size": 2, "boxes": []}, "layout: unknown field 'boxes'"),
    ],
)
def test_a_hostile_report_is_refused_naming_the_field(wire: Any, field: str) -> None:
    with pytest.raises(PayloadError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TPLayout.from_wire(wire)


def test_receiver_layouts_place_each_receiver_by_its_own_report() -> None:
    metas = [ParamMeta.of(n, t) for n, t in whole().items()]
    # Two TP groups of 2 (data parallel x TP) and a whole replica: rank 2 gets rank 0's boxes.
    reports = [TPLayout(0, 2, RULES).to_wire(), TPLayout(1, 2, RULES), None]
    reports.insert(2, TPLayout(0, 2, RULES).to_wire())
    lay = receiver_layouts(reports, metas)
    qkv = lay["layers.0.qkv_proj.weight"]
    assert qkv.boxes == (((0, 4), (0, 4)), ((4, 7), (0, 4)), ((0, 4), (0, 4)), ((0, 7), (0, 4)))
    with pytest.raises(PayloadError, match=r"weight_info\[1\]\.layout\.tp_rank"):
        receiver_layouts([None, {"tp_rank": 5, "tp_size": 2}], metas)
    with pytest.raises(PayloadError, match="no receivers"):
        receiver_layouts([], metas)


def test_an_absent_tensor_has_no_box_and_no_chunk() -> None:
    """``absent``: an expert this receiver does not hold (an expert-parallel placement)."""
    full = whole()
    metas = [ParamMeta.of(n, t) for n, t in full.items()]
    lay = TPLayout(1, 2, (("*.o_proj.*", "absent"), *RULES))
    assert TPLayout.from_wire(lay.to_wire()) == lay
    assert lay.box("layers.0.o_proj.weight", (4, 5)) is None
    with pytest.raises(PayloadError, match="'layers.0.o_proj.bias': this receiver holds none"):
        lay.local("layers.0.o_proj.bias", full["layers.0.o_proj.bias"])
    dst = receiver_layouts([TPLayout(0, 2, RULES), lay], metas)
    assert dst["layers.0.o_proj.weight"].boxes == (((0, 4), (0, 3)), None)
    src = {m.name: Layout.whole(m.shape) for m in metas}
    plan = plan_transfer([(m, src[m.name], dst[m.name]) for m in metas])
    assert not {"layers.0.o_proj.weight", "layers.0.o_proj.bias"} & {
        c.name for c in plan.select(dst=1)
    }
    assert plan.nbytes(dst=1) == sum(
        lay.local(n, t).nbytes for n, t in full.items() if lay.kind(n) != "absent"
    )


def test_a_worker_reports_its_sinks_layout_and_none_for_whole_replicas() -> None:
    lay = TPLayout(0, 2, RULES)
    sliced = {n: lay.local(n, t).clone() for n, t in whole().items()}
    w = WeightSyncWorker("inline", ModuleSink(build_module(sliced), layout=lay))
    assert w.weight_info()["layout"] == lay.to_wire()
    plain = WeightSyncWorker("inline", ModuleSink(build_module(whole())))
    assert plain.weight_info()["layout"] is None
    with pytest.raises(PayloadError, match="layout: expected a TPLayout"):
        ModuleSink(build_module(whole()), layout={"tp_rank": 0})  # type: ignore[arg-type]


def _entry(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One receiver's inline update: its slices packed back to back (no padding needed for
    one tensor per update, which is what the inline engine's bucket rule expects here)."""
    names = list(tensors)
    (name,) = names
    t = tensors[name].contiguous()
    return {
        "names": names,
        "dtype_names": ["float32"],
        "shapes": [list(t.shape)],
        "data": base64.b64encode(t.numpy().tobytes()).decode(),
    }


@contextlib.contextmanager
def _http(fleet: list[WeightSyncWorker]) -> Iterator[Any]:
    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_http_client.routes import ReceiverRoutes
    from wtcore_http_client.server import ReceiverHTTPServer

    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ReceiverHTTPServer(ReceiverRoutes(w))).url for w in fleet]
        yield stack.enter_context(HTTPWeightSyncClient(urls, timeout_s=60))


@pytest.mark.processes
@pytest.mark.parametrize(("m", "n"), [(2, 2), (2, 3), (3, 2), (1, 2)])
def test_trainer_plans_from_reports_read_over_http_and_each_receiver_gets_only_its_slices(
    m: int, n: int
) -> None:
    pytest.importorskip("wtcore_http_client")
    full = whole()
    metas = [ParamMeta.of(k, t) for k, t in full.items()]
    lays = [TPLayout(r, n, RULES) for r in range(n)]
    fleet = [
        WeightSyncWorker(
            "inline",
            ModuleSink(
                build_module({k: torch.zeros_like(lays[r].local(k, t)) for k, t in full.items()}),
                layout=lays[r],
            ),
            rank=r,
            world_size=n,
        )
        for r in range(n)
    ]
    # The trainer: m ranks, FSDP-style Shard(0) of every tensor.
    src = {k: Layout.placed(t.shape, (m,), (Shard(0),)) for k, t in full.items()}
    with _http(fleet) as client:
        reports = [info["layout"] for info in client.weight_info()]
        dst = receiver_layouts(reports, metas)
        plan = plan_transfer([(meta, src[meta.name], dst[meta.name]) for meta in metas])
        parts, got = execute_plan(full, plan, src, dst)
        for r in range(n):
            # exactly the receiver's slices, counted: never another receiver's
            slice_bytes = sum(lays[r].local(k, t).nbytes for k, t in full.items())
            assert plan.nbytes(dst=r) == got[r] == slice_bytes
            for k in full:
                assert torch.equal(parts[(k, r)], lays[r].local(k, full[k]))
        # Deliver the assembled slices in a real round, one entry per receiver and tensor.
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 12})
        client.start_weight_update()
        for k in full:
            client.update_weights([_entry({k: parts[(k, r)]}) for r in range(n)])
        client.finish_weight_update("sharded-1")
        for info in client.weight_info():
            assert info["consistent"] and info["weight_version"] == "sharded-1"
    for r, w in enumerate(fleet):
        held = dict(w.sink.module.named_parameters())  # type: ignore[attr-defined]
        for k, t in full.items():
            assert torch.equal(held[k], part(t, lays[r].box(k, tuple(t.shape)))), (r, k)
        w.shutdown()


# ------------------------------------------------------- a receiver declaring an absurd TP size


def test_more_tp_ranks_than_elements_is_refused_before_the_round_starts() -> None:
    """A receiver declaring TP=65,536 for a model whose split dimensions are a few rows: the
    trainer refuses it while planning, naming the receiver, the field and the tensor, and no
    receiver sees the round."""
    from wtcore.testing.sharded import PartsSource
    from wtcore.testing.sharded_contract import RULES as SUITE_RULES
    from wtcore.testing.sharded_contract import receivers
    from wtcore.testing.sharded_contract import whole as suite_whole
    from wtcore_kit.inline import InlineTrainerEngine, InlineTrainerInitInfo
    from wtcore_kit.inproc import InProcessClient

    fleet = receivers(2, True)
    held = fleet[1].sink.module  # type: ignore[attr-defined]
    fleet[1].shutdown()
    huge = ModuleSink(held, layout=TPLayout(1, 1 << 16, SUITE_RULES))
    fleet[1] = WeightSyncWorker("inline", huge, rank=1, world_size=2)
    full = suite_whole()
    engine = InlineTrainerEngine.trainer_init(
        InlineTrainerInitInfo(rank=0), client=InProcessClient(fleet, timeout_s=60)
    )
    src = PartsSource(full, {k: Layout.whole(t.shape) for k, t in full.items()}, 0)
    with pytest.raises(
        PayloadError,
        match=r"weight_info\[1\]\.layout\.tp_size: 65536 ranks split dimension 0 of 11 "
        r"elements \('embed\.weight'\)",
    ):
        engine.send_weights(src, weight_version="v1")
    for w in fleet:
        info = w.weight_info()
        assert info["rounds_ok"] == info["rounds_failed"] == 0 and info["weight_version"] is None
        assert info["round_bytes"] == {"planned": 0, "landed": 0}
        w.shutdown()
    engine.shutdown()


def test_a_huge_legal_tp_size_costs_only_the_receivers_own_box(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TP=65,536 over tensors of 65,536 rows is legal: each TP rank holds one row. Planning
    computes that one row's box per distinct tensor shape, not 65,536 boxes per tensor (the
    boxes are counted: every one is a ``split``), and the plan sends the receiver its row."""
    import wtcore.sharded.layout as layout_module
    from wtcore.sharded.plan import PlannedRound

    rows = 1 << 16
    metas = [ParamMeta(f"layers.{i}.qkv_proj.weight", torch.float32, (rows, 2)) for i in range(8)]
    metas.append(ParamMeta("norm.weight", torch.float32, (2,)))
    src = {m.name: Layout.placed(m.shape, (2,), (Shard(0),)) for m in metas}
    calls = 0
    split = layout_module.split

    def counted(n: int, parts: int, index: int) -> tuple[int, int]:
        nonlocal calls
        calls += 1
        return split(n, parts, index)

    monkeypatch.setattr(layout_module, "split", counted)
    reports = [TPLayout(0, 2, RULES).to_wire(), TPLayout(rows - 1, rows, RULES).to_wire()]
    dst = receiver_layouts(reports, metas)
    assert calls == 2  # one box per receiver for the 8 tensors of one shape; the norm is whole
    assert dst[metas[0].name].boxes[1] == ((rows - 1, rows), (0, 2))
    planned = PlannedRound.make(metas, src, dst)
    plan = planned.plan
    assert plan.pairs(src=1) == [(1, 0), (1, 1)] and plan.pairs(src=0) == [(0, 0), (0, 1)]
    assert plan.nbytes(dst=1) == 8 * 2 * 4 + 2 * 4  # its row of each tensor, and the norm
    received = PlannedRound.from_wire(planned.to_wire())
    assert received.plan.select(dst=1) == plan.select(dst=1)
    assert calls == 2  # planning and decoding never built the TP group's other boxes
