"""``delta="auto"``: a delta round only when earlier rounds measured it to be the faster one.

The rule is checked on given measurements; then real rounds over the ``inline`` engine
(a real worker, a real sink, bit-exact after every round) check that the policy acts on it:
it measures both modes first, keeps no base while full rounds win, keeps one right before it
measures a delta round again, and follows a link that got slower or faster. The link is
scripted: what a round measured is replaced by what it would take on a link of a given rate
(``_Scripted``), since a quick test cannot make loopback slow without timing it. The real
links are measured in docs/benchmarks.md ("Delta rounds").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from wtcore import PayloadError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink
from wtcore.source import TensorSource
from wtcore.testing.sources import build_module, zeros_like_state
from wtcore.worker import WeightSyncWorker
from wtcore_delta.auto import PROBE_FIRST, PROBE_MAX, AutoDelta
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_kit.inproc import InProcessClient

MB = 10**8  # model bytes in the rule's examples


def test_the_rule_weighs_encoding_against_the_wire() -> None:
    auto = AutoDelta()
    assert auto.choose()[0] == "full" and auto.refresh_base()  # first: a full round, a base
    auto.measured("full", MB, 1.0, 0.0)  # a slow link: 1e8 bytes/s
    assert auto.choose() == ("delta", "auto: measuring a delta round")
    auto.measured("delta", MB, 0.3, 0.1)  # 0.1 s encoding, 0.2 s on the wire
    assert auto.ratio() == pytest.approx(0.1 + 0.2)
    mode, why = auto.choose()
    assert mode == "delta" and "expected delta 0.30x a full round" in why, why
    # The link got 20x faster (a full round measured it): the encoding alone now costs 2x.
    auto.measured("full", MB, 0.05, 0.0)
    assert auto.ratio() == pytest.approx(0.1 * 20 + 0.2)
    assert auto.winner() == "full"


def test_the_mode_that_lost_is_measured_again_ever_less_often() -> None:
    auto = AutoDelta()
    auto.measured("full", MB, 0.05, 0.0)  # fast link
    auto.measured("delta", MB, 0.2, 0.15)  # delta loses: encoding alone is 3x
    assert auto.winner() == "full"
    waits = []
    for _ in range(4):
        rounds = 0
        while (mode := auto.choose()[0]) == "full":
            rounds += 1
            assert auto.refresh_base() == (auto.wait <= 1)  # a base only before a probe
            auto.measured("full", MB, 0.05, 0.0)
        assert "measuring delta again" in auto.choose()[1]
        auto.measured(mode, MB, 0.2, 0.15)  # the probe loses again
        waits.append(rounds)
    assert waits == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, min(8 * PROBE_FIRST, PROBE_MAX)]


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128, 256, generator=g).to(torch.bfloat16) for i in range(4)}


def test_delta_is_validated_naming_the_field() -> None:
    with pytest.raises(PayloadError, match="delta: expected a bool or 'auto', got 'sometimes'"):
        InlineTrainerInitInfo(rank=0, delta="sometimes")


class _Scripted(AutoDelta):
    """Times as on a link of ``link`` bytes/s with an encoder of 1 GB/s: a full round moves
    the model, a delta round encodes it and moves a twentieth of it. Scripted whole, never
    the host's own timings: on a loaded host a slow version check in a full round once made
    delta look faster on the fast link."""

    link = 1e6

    def measured(self, mode: str, model_bytes: int, seconds: float, added: float) -> None:
        encode = model_bytes / 1e9 if mode == "delta" else 0.0
        wire = model_bytes if mode == "full" else model_bytes / 20
        super().measured(mode, model_bytes, encode + wire / self.link, encode)


class _Run:
    def __init__(self, trainer: Any, worker: WeightSyncWorker, state: dict[str, torch.Tensor]):
        self.trainer, self.worker, self.state, self.n = trainer, worker, state, 0

    @property
    def auto(self) -> _Scripted:
        auto = self.trainer.rounds.auto
        assert isinstance(auto, _Scripted)
        return auto

    def step(self) -> dict[str, Any]:
        """Change one element of every tensor (a sparse step), sync, check bit for bit."""
        self.n += 1
        for t in self.state.values():
            t.view(-1)[self.n] += 1
        stats = self.trainer.send_weights(weight_version=f"v{self.n}")
        for name, t in self.worker.sink.named_tensors():  # type: ignore[attr-defined]
            assert torch.equal(t, self.state[name]), name
        assert stats.delta is not None
        return {**stats.delta, "num_bytes": stats.num_bytes}


@pytest.fixture
def run() -> Iterator[_Run]:
    state = _state(0)
    worker = WeightSyncWorker("inline", ModuleSink(build_module(zeros_like_state(state))))
    info = InlineTrainerInitInfo(rank=0, delta="auto")
    client = InProcessClient([worker], timeout_s=30)
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    ) as trainer:
        assert isinstance(trainer.rounds.auto, AutoDelta)
        trainer.rounds.auto = _Scripted()
        yield _Run(trainer, worker, state)
    worker.shutdown()


def test_auto_measures_both_then_follows_the_link(run: _Run) -> None:
    model = sum(t.numel() * t.element_size() for t in run.state.values())
    first = run.step()  # a full round that keeps a base, then a delta round: both measured
    assert (first["mode"], first["why"], first["base_copies"]) == (
        "full", "auto: measuring a full round; no base yet (first round, a failed round, "
        "or no weight_version)", 4,
    )  # fmt: skip
    second = run.step()
    assert (second["mode"], second["why"]) == ("delta", "auto: measuring a delta round")
    assert second["num_bytes"] < model / 20
    assert run.auto.ratio() is not None

    # A slow link (1 MB/s): delta wins, and the rounds go as delta.
    slow = run.step()
    assert slow["mode"] == "delta" and slow["why"].startswith("auto: expected delta"), slow
    assert slow["num_bytes"] < model / 20

    # The link gets fast: the next full round (the probe of the mode that lost) measures it,
    # and then full rounds win. They keep no base (no copy of the model) ...
    run.auto.link = 1e15
    while (r := run.step())["mode"] == "delta":
        pass
    assert "measuring full again" in r["why"] and r["base_copies"] == 4, r
    fast = run.step()
    assert (fast["mode"], fast["base_copies"]) == ("full", 0), fast
    assert fast["num_bytes"] >= model
    assert run.trainer.rounds.tracker.version is None
    # ... until the round before delta is measured again, which keeps one for it.
    while run.auto.wait > 1:
        assert run.step()["base_copies"] == 0
    assert run.step()["base_copies"] == 4
    probe = run.step()
    assert probe["mode"] == "delta" and "measuring delta again" in probe["why"], probe
    assert run.step()["mode"] == "full"  # it lost again

    # The link slows down: the next full round measures it, and delta wins at once (after
    # one full round that keeps a base, since full rounds kept none).
    run.auto.link = 1e6
    assert run.step()["mode"] == "full"
    refresh = run.step()
    assert refresh["mode"] == "full" and refresh["base_copies"] == 4, refresh
    assert refresh["why"].startswith("auto: expected delta"), refresh
    after = run.step()
    assert after["mode"] == "delta" and after["why"].startswith("auto: expected delta"), after
    assert after["num_bytes"] < model / 20
