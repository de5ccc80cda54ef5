"""``IPCTrainerInitInfo.share_weights`` (on by default): the engine moves a ``ModuleSource``'s
model into shared memory at its first round, where nothing else can notice the move, and every
round then copies once, straight out of the model. Real worker processes and real shared memory
where the rounds cross processes; in-process workers where only the trainer's side is at stake.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from wtcore import ModuleSink, ModuleSource, WeightSyncWorker, WeightTransferTrainerFactory
from wtcore.errors import PayloadError
from wtcore.testing import RecordingClient, build_module
from wtcore_ipc import IPCTrainerInitInfo, share_weights
from wtcore_ipc.shared import locate, why_not_movable
from wtcore_kit.inproc import InProcessClient

pytestmark = [pytest.mark.timeout(180)]


def _updates(client: RecordingClient) -> list[dict[str, Any]]:
    return [p for c, p in client.calls if c == "update_weights"]


@contextlib.contextmanager
def _in_process(
    model: torch.nn.Module, **kw: Any
) -> Iterator[tuple[Any, RecordingClient, torch.nn.Module]]:
    """A trainer over ``ModuleSource(model)`` and one in-process worker with a zeroed twin
    (``served``); both shut down on exit."""
    served = build_module({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    worker = WeightSyncWorker("ipc", ModuleSink(served))
    client = RecordingClient(InProcessClient([worker], timeout_s=60))
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, timeout_s=30, **kw), client=client, source=ModuleSource(model)
    )
    try:
        yield trainer, client, served
    finally:
        trainer.shutdown()
        worker.shutdown()


def _assert_served(served: torch.nn.Module, model: torch.nn.Module) -> None:
    got = dict(served.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p.detach().contiguous()), name


def test_a_module_source_moves_into_shared_memory_at_its_first_round(
    two_workers: list[Any], procs: Any
) -> None:
    """Two worker processes, the default settings: from the first round on, one
    ``update_weights`` per round names offsets in the model's own segment (no ring), the
    parameters keep their identity, and the engine closes the segment at shutdown."""
    state = procs.make_state(31)
    for w in two_workers:
        w.setup(state)
    model = build_module(state)
    params = dict(model.named_parameters())
    client = RecordingClient(procs.PipeClient(two_workers, timeout_s=60))
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, timeout_s=30), client=client, source=ModuleSource(model)
    )
    try:
        assert all(locate(p) is None for p in params.values()), "nothing moves before a round"
        for r in range(3):
            procs.bump(params)
            stats = trainer.send_weights(weight_version=f"a{r}")
            want = {n: p.detach() for n, p in params.items()}
            for w in two_workers:
                procs.assert_bit_exact(w.dump(), want)
                info = w.call("weight_info")
                assert info["consistent"] is True and info["weight_version"] == f"a{r}"
            assert stats.num_bytes == sum(p.numel() * p.element_size() for p in params.values())
        updates = _updates(client)
        assert len(updates) == 3 and all("offsets" in u and "num_slots" not in u for u in updates)
        assert len({u["segment"] for u in updates}) == 1, "moved once, at the first round"
        assert trainer.segment_name is None, "no ring was ever allocated"
        assert all(dict(model.named_parameters())[n] is p for n, p in params.items())
        assert all(locate(p) is not None for p in params.values() if p.numel())
    finally:
        trainer.shutdown()
    assert all(locate(p) is None for p in params.values()), "closed with the engine"
    last = updates[-1]
    assert not procs.reachable(last["segment"], last["segment_fd"]), "closed to new workers"
    procs.bump(params)  # the model keeps its memory after the engine is gone
    assert all(torch.isfinite(p.float()).all() for p in params.values())


def _trained(share: bool) -> tuple[torch.nn.Module, torch.nn.Module, list[dict[str, Any]]]:
    """Three AdamW steps of a small bf16 model, a round after each (the optimizer built before
    the trainer, as in a training script)."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    with _in_process(model, share_weights=share) as (trainer, client, served):
        for step in range(3):
            model(data).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            trainer.send_weights(weight_version=f"s{step}")
            _assert_served(served, model)
        assert optimizer.param_groups[0]["params"][0] is model[0].weight
    return model, served, _updates(client)


def test_training_a_moved_model_gives_the_same_weights_as_training_it_in_place() -> None:
    """The optimizer, built before the move, keeps training the same parameters: three AdamW
    steps with rounds give bit-identical weights with ``share_weights`` on and off, and only
    the off run goes through the ring."""
    shared_model, _, shared_updates = _trained(True)
    ring_model, _, ring_updates = _trained(False)
    for (name, a), (_, b) in zip(
        shared_model.named_parameters(), ring_model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all("offsets" in u for u in shared_updates)
    assert all("num_slots" in u and "offsets" not in u for u in ring_updates)


def test_share_weights_false_leaves_the_model_where_it_is() -> None:
    model = build_module({"a.w": torch.randn(256, 64), "b.w": torch.randn(64)})
    where = {n: p.data_ptr() for n, p in model.named_parameters()}
    with _in_process(model, share_weights=False) as (trainer, client, served):
        trainer.send_weights(weight_version="v1")
        _assert_served(served, model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
    assert all("num_slots" in u for u in _updates(client))


def _kept_state_dict(model: torch.nn.Module) -> Any:
    return model.state_dict()  # views of every parameter, kept by the caller


def _flat_buffer(model: torch.nn.Module) -> Any:
    flat = torch.zeros(256 * 64 + 64)  # the parameters become views of one kept buffer
    with torch.no_grad():
        for p, (start, n) in zip(model.parameters(), ((0, 256 * 64), (256 * 64, 64)), strict=True):
            flat[start : start + n].copy_(p.reshape(-1))
            p.data = flat[start : start + n].view(p.shape)
    return flat


def _transposed(model: torch.nn.Module) -> Any:
    first = next(iter(model.parameters()))
    first.data = first.data.t().contiguous().t()  # same values, not contiguous
    return None


@pytest.mark.parametrize(
    ("prepare", "reason"),
    [
        (_kept_state_dict, "'a.w' shares its memory with 1 other tensor"),
        (_flat_buffer, "'a.w' shares its memory with 1 other tensor"),
        (_transposed, "'a.w' is not contiguous"),
    ],
    ids=["kept-state-dict", "flat-buffer", "non-contiguous"],
)
def test_a_model_others_could_see_moving_stays_where_it_is(
    prepare: Callable[[torch.nn.Module], Any], reason: str, caplog: Any
) -> None:
    """Memory that something else refers to (a kept ``state_dict()``, a flat buffer the
    parameters are views of) or a layout the move would change is left alone: rounds go
    through the ring, bit-exact, the log says why, and whatever referred to the parameters
    still sees them change."""
    model = build_module({"a.w": torch.randn(256, 64), "b.w": torch.randn(64)})
    kept = prepare(model)
    where = {n: p.data_ptr() for n, p in model.named_parameters()}
    with (
        _in_process(model) as (trainer, client, served),
        caplog.at_level(logging.INFO, logger="wtcore_ipc.trainer"),
    ):
        for r in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            trainer.send_weights(weight_version=f"v{r}")
            _assert_served(served, model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
    assert all("num_slots" in u for u in _updates(client))
    said = [r.getMessage() for r in caplog.records if "stays where it is" in r.getMessage()]
    assert len(said) == 1 and reason in said[0], said
    if isinstance(kept, dict):
        assert torch.equal(kept["a.w"], model.a.w), "the kept views still follow the model"
    if isinstance(kept, torch.Tensor):
        assert torch.equal(kept[:64], model.a.w.detach().reshape(-1)[:64])


def test_a_tied_model_moves_once_and_stays_tied() -> None:
    emb = torch.nn.Embedding(32, 16)
    head = torch.nn.Linear(16, 32, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with _in_process(model) as (trainer, _, served):
        for r in range(2):
            with torch.no_grad():
                emb.weight.mul_(2)
            trainer.send_weights(weight_version=f"v{r}")
            _assert_served(served, model)
        assert model["head"].weight is model["emb"].weight
        found = locate(model["emb"].weight)
        assert found is not None and found[1] == 0
        assert found[0].nbytes < 2 * 32 * 16 * 4, "one copy of the table, not two"


def test_a_model_the_caller_shared_stays_the_caller_s() -> None:
    """The engine neither moves nor closes weights its caller shared with ``share_weights``."""
    model = build_module({"a.w": torch.randn(128, 32)})
    with share_weights(model) as shared:
        with _in_process(model) as (trainer, client, served):
            trainer.send_weights(weight_version="v1")
            _assert_served(served, model)
        assert shared.name is not None, "still open: it is the caller's to close"
        assert all(u["segment"] == shared.name for u in _updates(client))


def test_share_weights_must_be_a_bool() -> None:
    with pytest.raises(PayloadError, match="share_weights: expected a bool, got 'yes'"):
        IPCTrainerInitInfo(rank=0, share_weights="yes")  # type: ignore[arg-type]


def test_why_not_movable_names_the_tensor() -> None:
    """Each rule on its own, with the tensor it names (the engine logs this line)."""
    with torch.inference_mode():
        frozen = torch.ones(3)
    cases: list[tuple[list[tuple[str, torch.Tensor]], str | None]] = [
        ([("w", torch.ones(4)), ("b", torch.ones(2))], None),
        ([("w", torch.ones(4, device="meta"))], "'w' is not a dense CPU tensor"),
        ([("w", torch.ones(4).to_sparse())], "'w' is not a dense CPU tensor"),
        ([("w", frozen)], "'w' is an inference tensor"),
        ([("w", torch.ones(3, 4).t())], "'w' is not contiguous"),
    ]
    for named, want in cases:
        got = why_not_movable(named)
        assert (got is None) if want is None else (got is not None and want in got), (want, got)
    base = torch.ones(8)
    first, second = base[:6], base[4:]
    del base
    got = why_not_movable([("first", first), ("second", second)])
    assert got is not None and "'first' and 'second' overlap in memory" in got


_MOVE_PEAK = """
import gc, json, torch
from wtcore_kit.synthetic import build_module
from wtcore_ipc import share_weights

def kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))

# 256 MiB in 300 tensors of under 1 MiB: heap memory, which glibc keeps once freed
model = build_module({f"l{i}.w": torch.ones(446_000, dtype=torch.bfloat16) for i in range(300)})
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = kib("VmRSS")
shared = share_weights(model)
gc.collect()
print(json.dumps({"peak": kib("VmHWM") - before, "after": kib("VmRSS") - before,
                  "nbytes": shared.nbytes}))
"""


def test_moving_a_model_does_not_hold_its_memory_twice() -> None:
    """The old tensors' memory goes back to the kernel as the move goes (glibc keeps freed
    heap memory otherwise): in a fresh process, a 256 MiB model's move peaks at well under
    half its size above where it started, and ends about where it started."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MOVE_PEAK], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    model_kib = got["nbytes"] // 1024
    assert model_kib > 250 * 1024
    assert got["peak"] < model_kib // 2, got
    assert got["after"] < model_kib // 4, got


@pytest.mark.parametrize("include_buffers", [False, True])
def test_buffers_move_when_the_source_sends_them(include_buffers: bool) -> None:
    """What moves is what the source yields: a BatchNorm's running statistics move with
    ``include_buffers=True`` only, and arrive bit-exact either way they travel."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    model(torch.randn(8, 32))  # running statistics that differ from their initial values
    served = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    with torch.no_grad():
        for t in [*served.parameters(), *served.buffers()]:
            t.zero_()
    worker = WeightSyncWorker("ipc", ModuleSink(served))
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, timeout_s=30),
        client=InProcessClient([worker], timeout_s=60),
        source=ModuleSource(model, include_buffers=include_buffers),
    )
    try:
        stats = trainer.send_weights(weight_version="v1")
        assert stats.phase_seconds["pack"] > 0, "the move is a copy in round 0's time"
        assert locate(model[0].weight) is not None
        assert (locate(model[1].running_mean) is not None) == include_buffers
        got, want = served.state_dict(), model.state_dict()
        for name in ["0.weight", "1.bias"] + (["1.running_mean"] if include_buffers else []):
            assert torch.equal(got[name], want[name]), name
        assert stats.num_tensors == 4 + (3 if include_buffers else 0)
        again = trainer.send_weights(weight_version="v2")
        assert again.phase_seconds["pack"] == 0, "moved once: later rounds copy nothing here"
    finally:
        trainer.shutdown()
        worker.shutdown()


def test_a_model_that_left_its_shared_weights_gets_them_closed(procs: Any) -> None:
    """Parameters replaced after the move (as ``model.to(...)`` or ``model.half()`` do) live
    elsewhere: the next round goes through the ring, bit-exact, and the engine closes the
    segment it made, which would otherwise hold the model's old bytes until shutdown."""
    model = build_module({"a.w": torch.randn(256, 64), "b.w": torch.randn(64)})
    with _in_process(model) as (trainer, client, served):
        trainer.send_weights(weight_version="v1")
        first = _updates(client)[-1]
        assert "offsets" in first and procs.reachable(first["segment"], first["segment_fd"])
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone() + 1  # new storage, as a dtype or device move makes
        trainer.send_weights(weight_version="v2")
        _assert_served(served, model)
        assert "num_slots" in _updates(client)[-1], "through the ring"
        assert not procs.reachable(first["segment"], first["segment_fd"]), "closed at once"
