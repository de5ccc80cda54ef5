"""The delta-round suite every engine pair passes (subclass it like ``EngineContractSuite``;
the suite turns ``delta`` on). Rounds are real training steps, then one where nothing changes and
one where every element does, each checked bit-exact. It needs wtcore-delta, but stays here so
engine authors import every suite from ``wtcore.testing`` (which production code never imports).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from wtcore.errors import ReceiverError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink, WeightSink
from wtcore.source import TensorSource
from wtcore.testing.contract import SwitchableSink
from wtcore.testing.realistic import realistic_steps
from wtcore.testing.sources import build_module, zeros_like_state
from wtcore.worker import WeightSyncWorker
from wtcore_delta.codec import bits
from wtcore_kit.inproc import InProcessClient

if TYPE_CHECKING:
    import torch

    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["DeltaContractSuite", "DictSink", "assert_bits_equal", "delta_chain"]


@functools.lru_cache(maxsize=1)
def _steps() -> tuple[dict[str, torch.Tensor], ...]:
    return tuple(realistic_steps(10, lr=1e-5, d_model=64, vocab=512, seq=32, batch=4))


def delta_chain(dtype: torch.dtype | None = None) -> list[dict[str, torch.Tensor]]:
    """Real steps, then one where nothing changes, then one where every element does."""
    import torch

    want = dtype or torch.bfloat16
    states = [{n: t.to(want, copy=True) for n, t in s.items()} for s in _steps()]
    every = {n: t.clone() for n, t in states[-1].items()}
    for t in every.values():
        b = bits(t)
        b.copy_(b ^ 1)  # flip the lowest bit of every element: all change, all stay finite
    states += [{n: t.clone() for n, t in states[-1].items()}, every]
    return states


def assert_bits_equal(held: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits (NaN payloads and -0.0 included)."""
    import torch

    assert sorted(held) == sorted(want), f"names differ: {sorted(held)} vs {sorted(want)}"
    for name, w in want.items():
        h = held[name].detach().cpu()
        assert h.dtype == w.dtype and h.shape == w.shape, f"{name}: {h.dtype}{list(h.shape)}"
        assert torch.equal(bits(h.contiguous()), bits(w.contiguous())), f"{name}: bits differ"


class DictSink:
    """A readable sink that takes any name and shape (a model that grows)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        for name, t in weights:
            self.tensors[name] = t.detach().clone()

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


@dataclass
class DeltaPair:
    trainer: TrainerWeightTransferEngine
    workers: list[WeightSyncWorker]
    sinks: list[Any]
    client: InProcessClient
    source: TensorSource


def _held(sink: Any) -> dict[str, torch.Tensor]:
    return dict(sink.named_tensors())


class DeltaContractSuite:
    """Delta rounds, bit-exact, over one engine pair."""

    backend: ClassVar[str] = ""
    timeout_s: ClassVar[float] = 30.0
    device: ClassVar[str] = "cpu"

    pytestmark = [pytest.mark.timeout(180)]

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> TrainerInitInfo:
        raise NotImplementedError

    @contextmanager
    def source_for(self, state: dict[str, torch.Tensor]) -> Iterator[TensorSource]:
        yield TensorSource(state)

    def worker(self, sink: WeightSink, rank: int, n: int, **kw: Any) -> WeightSyncWorker:
        return WeightSyncWorker(
            self.backend, sink, device=self.device, rank=rank, world_size=n, **kw
        )

    @contextmanager
    def pair(
        self,
        state: dict[str, torch.Tensor],
        *,
        num_workers: int = 2,
        sink_factory: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        **worker_kw: Any,
    ) -> Iterator[DeltaPair]:
        def module_sink(s: dict[str, torch.Tensor]) -> Any:
            return ModuleSink(build_module(zeros_like_state(s)))

        make = sink_factory or module_sink
        sinks = [make(state) for _ in range(num_workers)]
        workers = [self.worker(s, i, num_workers, **worker_kw) for i, s in enumerate(sinks)]
        client = InProcessClient(workers, timeout_s=self.timeout_s)
        trainer = None
        try:
            with self.source_for(state) as source:
                info = self.make_trainer_init_info(
                    num_workers=num_workers, buffer_size_bytes=1 << 18
                )
                info.delta = True
                trainer = WeightTransferTrainerFactory.trainer_init(
                    info, client=client, source=source
                )
                yield DeltaPair(trainer, workers, sinks, client, source)
        finally:
            if trainer is not None:
                trainer.shutdown()
            for w in workers:
                w.shutdown()

    @staticmethod
    def step_to(p: DeltaPair, new: Mapping[str, torch.Tensor]) -> None:
        for n, t in p.source._items:
            t.copy_(new[n])

    def run_chain(self, p: DeltaPair, chain: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        modes = []
        for step, new in enumerate(chain):
            self.step_to(p, new)
            stats = p.trainer.send_weights(weight_version=f"s{step}", verify=step % 4 == 3)
            assert stats.delta is not None
            modes.append({**stats.delta, "bytes": stats.num_bytes})
            for s, w in zip(p.sinks, p.workers, strict=True):
                assert_bits_equal(_held(s), new)
                info = w.weight_info()
                assert (info["weight_version"], info["consistent"]) == (f"s{step}", True)
        return modes

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
    def test_chain_bit_exact(self, dtype: str) -> None:
        import torch

        chain = delta_chain(getattr(torch, dtype))
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state) as p:
            modes = self.run_chain(p, chain)
            tracker = getattr(p.trainer.rounds, "tracker")  # noqa: B009 (wtcore-delta's policy)
            header = tracker.mark()[1].numel()  # a full round names the trainer's lineage first
        model = modes[0]["model_bytes"]
        assert modes[0]["mode"] == "full" and modes[0]["bytes"] == model + header
        assert [m["mode"] for m in modes[1:]] == ["delta"] * (len(chain) - 1)
        for m in modes[1:-2]:  # the real steps: a few percent changed, far fewer bytes
            assert 0 < m["changed_fraction"] < 0.2
            assert m["bytes"] * 3 < model, m
        none, every = modes[-2], modes[-1]
        assert every["changed_fraction"] == 1.0 and every["tensors"]["full"] == len(state)
        assert none["changed_fraction"] == 0.0 and none["bytes"] < 4096

    def test_transactional_chain(self) -> None:
        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state, transactional=True) as p:
            modes = self.run_chain(p, chain[:6])
        assert [m["mode"] for m in modes] == ["full"] + ["delta"] * 5

    def test_receiver_failed_previous_round(self) -> None:
        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}

        def flaky(s: dict[str, torch.Tensor]) -> Any:
            return SwitchableSink(build_module(zeros_like_state(s)))

        with self.pair(state, sink_factory=flaky) as p:
            self.run_chain(p, chain[:3])
            self.step_to(p, chain[3])
            p.sinks[1].fail_after(0)
            with pytest.raises(ReceiverError):
                p.trainer.send_weights(weight_version="broken")
            p.sinks[1].heal()
            assert p.workers[1].weight_info()["consistent"] is False
            stats = p.trainer.send_weights(weight_version="healed")
            assert stats.delta is not None and stats.delta["mode"] == "full"
            for s in p.sinks:
                assert_bits_equal(_held(s), chain[3])
            self.step_to(p, chain[4])
            stats = p.trainer.send_weights(weight_version="next")
            assert stats.delta is not None and stats.delta["mode"] == "delta"
            for s in p.sinks:
                assert_bits_equal(_held(s), chain[4])

    def _swap_in_fresh(self, p: DeltaPair, state: dict[str, torch.Tensor]) -> None:
        """Worker 1 restarts (a late joiner): fresh weights, no version; the trainer re-inits."""
        old = p.workers[1]
        old.shutdown()
        sink = ModuleSink(build_module(zeros_like_state(state)))
        p.sinks[1] = sink
        p.workers[1] = p.client.workers[1] = self.worker(sink, 1, len(p.workers))
        p.trainer.needs_handshake = True

    def test_late_joiner_gets_full_round(self) -> None:
        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state) as p:
            self.run_chain(p, chain[:3])
            self._swap_in_fresh(p, state)
            self.step_to(p, chain[3])
            stats = p.trainer.send_weights(weight_version="joined")
            assert stats.delta is not None and stats.delta["mode"] == "full"
            assert "receiver 1" in stats.delta["why"]
            for s in p.sinks:
                assert_bits_equal(_held(s), chain[3])

    def test_refusal_falls_back_to_full(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # weight_info says every receiver holds the base, but one restarted since: the
        # receiver refuses the patches and the trainer sends a full round by itself.
        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state) as p:
            self.run_chain(p, chain[:3])
            self._swap_in_fresh(p, state)
            real = p.client.weight_info

            def stale_view() -> list[dict[str, Any]]:
                return [{**i, "weight_version": "s2", "consistent": True} for i in real()]

            monkeypatch.setattr(p.client, "weight_info", stale_view)
            self.step_to(p, chain[3])
            stats = p.trainer.send_weights(weight_version="after-refusal")
            assert stats.delta is not None and stats.delta["mode"] == "full"
            assert "refused" in stats.delta["why"]
            for s, w in zip(p.sinks, p.workers, strict=True):
                assert_bits_equal(_held(s), chain[3])
                assert w.weight_info()["weight_version"] == "after-refusal"

    def test_new_tensor_and_shape_change(self) -> None:
        import torch

        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state, sink_factory=lambda s: DictSink()) as p:
            self.run_chain(p, chain[:3])
            grown = {n: t.clone() for n, t in chain[3].items()}
            first = next(iter(grown))
            grown[first] = grown[first].reshape(-1)[:-1].clone()  # a shape change
            grown["new.w"] = torch.arange(12, dtype=torch.bfloat16)  # a new tensor
            p.source._items = list(grown.items())
            stats = p.trainer.send_weights(weight_version="grown")
            assert stats.delta is not None and stats.delta["mode"] == "delta"
            assert stats.delta["tensors"]["full"] >= 2
            for s in p.sinks:
                held = _held(s)
                assert_bits_equal({n: held[n] for n in grown}, grown)

    def test_bad_patch_publishes_nothing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from wtcore_delta import codec

        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        real = codec.plan

        def corrupt(new: torch.Tensor, base: torch.Tensor, **kw: Any) -> Any:
            enc, finish = real(new, base, **kw)
            if enc.blob is not None:
                enc.blob[8] = 99  # an unknown position encoding
            return enc, finish

        with self.pair(state, transactional=True) as p:
            self.run_chain(p, chain[:2])
            monkeypatch.setattr("wtcore_delta.trainer.plan", corrupt)
            self.step_to(p, chain[2])
            with pytest.raises(ReceiverError, match="delta patch for") as err:
                p.trainer.send_weights(weight_version="bad")
            assert "PayloadError" in str(err.value)
            for s, w in zip(p.sinks, p.workers, strict=True):
                assert_bits_equal(_held(s), chain[1])  # staged: the old weights keep serving
                info = w.weight_info()
                assert (info["weight_version"], info["consistent"]) == ("s1", True)
            monkeypatch.setattr("wtcore_delta.trainer.plan", real)
            stats = p.trainer.send_weights(weight_version="good")
            assert stats.delta is not None and stats.delta["mode"] == "full"  # base dropped
            for s in p.sinks:
                assert_bits_equal(_held(s), chain[2])

    def test_verify_checks_whole_weights_after_a_delta_round(self) -> None:
        # A receiver whose weights drifted without a failed round (a bit flipped in memory)
        # still reports the base version: the patches apply over the drift, and verify=True,
        # comparing whole-tensor digests, refuses to publish; the next round is full and exact.
        import torch

        from wtcore.errors import VerificationError

        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state) as p:
            self.run_chain(p, chain[:2])
            name, held = next(iter(_held(p.sinks[0]).items()))
            same = bits(chain[1][name]) == bits(chain[2][name])
            at = int(same.nonzero()[0])  # an element the next step leaves alone
            with torch.no_grad():
                b = bits(held.detach())
                b[at] ^= 1 << 3
            self.step_to(p, chain[2])
            with pytest.raises(VerificationError, match="receiver 0"):
                p.trainer.send_weights(weight_version="drifted", verify=True)
            stats = p.trainer.send_weights(weight_version="repaired", verify=True)
            assert stats.delta is not None and stats.delta["mode"] == "full"
            for s in p.sinks:
                assert_bits_equal(_held(s), chain[2])

    def test_sink_without_patches_gets_full_rounds(self) -> None:
        class LoadOnly:
            """Like vLLM's layerwise reload: takes whole tensors, shows nothing."""

            accepts_patches = False

            def __init__(self, s: dict[str, torch.Tensor]) -> None:
                self.inner = ModuleSink(build_module(zeros_like_state(s)))

            def load_weights(self, weights: Any) -> None:
                self.inner.load_weights(weights)

            def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
                return self.inner.named_tensors()

        chain = delta_chain()
        state = {n: t.clone() for n, t in chain[0].items()}
        with self.pair(state, sink_factory=LoadOnly) as p:
            assert all(w.weight_info()["delta"] is False for w in p.workers)
            modes = self.run_chain(p, chain[:3])
        assert [m["mode"] for m in modes] == ["full"] * 3
        assert all("does not take patches" in m["why"] for m in modes[1:])
