"""The contract suite every engine pair (trainer engine + worker engine) passes on CPU.

Subclass :class:`EngineContractSuite` in a test module, name it ``Test...``, set ``backend``
and implement :meth:`~EngineContractSuite.make_trainer_init_info`::

    from wtcore_kit.inline import InlineTrainerInitInfo
    from wtcore.testing.contract import EngineContractSuite

    class TestLocalContract(EngineContractSuite):
        backend = "inline"

        def make_trainer_init_info(self, *, num_workers, buffer_size_bytes):
            return InlineTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, rank=0)

Receivers are in-process workers behind ``InProcessClient`` (each call on its own thread, so
blocking worker calls work), and every payload is checked to survive a JSON round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from wtcore.errors import PayloadError
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.sink import ModuleSink, WeightSink
from wtcore.source import TensorSource, WeightSource
from wtcore.testing.recording import RecordingClient
from wtcore.testing.sources import (
    MISMATCH_KINDS,
    MismatchedSource,
    build_module,
    mixed_dtype_state,
    zeros_like_state,
)
from wtcore.worker import WeightSyncWorker
from wtcore_kit.inproc import InProcessClient

if TYPE_CHECKING:
    import torch

    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["EngineContractSuite", "Pair", "SwitchableSink", "assert_state_equal"]


def assert_state_equal(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of ``state`` is bit-exact (``torch.equal``) in ``module``."""
    import torch

    held = dict(module.named_parameters())
    assert sorted(held) == sorted(state), f"names differ: {sorted(held)} vs {sorted(state)}"
    for name, want in state.items():
        got = held[name]
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got.detach().cpu(), want.cpu()), f"{name}: values differ"


@dataclass
class Pair:
    """A trainer engine wired to in-process receivers."""

    trainer: TrainerWeightTransferEngine
    workers: list[WeightSyncWorker]
    modules: list[torch.nn.Module]
    client: RecordingClient


class _RejectingSink:
    def load_weights(self, weights: Any) -> None:
        names = [n for n, _ in weights]
        raise PayloadError(f"sink rejects {names[:3]}")


class SwitchableSink(ModuleSink):
    """A flaky receiver's sink: after :meth:`fail_after` lets ``n`` more batches load, every
    batch raises ``RuntimeError`` (a receiver-side fault, not a payload error) until :meth:`heal`.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self._allowed: int | None = None

    def fail_after(self, n: int) -> None:
        self._allowed = n

    def heal(self) -> None:
        self._allowed = None

    def load_weights(self, weights: Any) -> None:
        if self._allowed is not None:
            if self._allowed <= 0:
                raise RuntimeError("injected sink failure (contract suite)")
            self._allowed -= 1
        super().load_weights(weights)


def _bump(state: Mapping[str, torch.Tensor]) -> None:
    import torch

    for t in state.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.numel():
            t.add_(1)


def _many_bucket_state(seed: int) -> dict[str, torch.Tensor]:
    """Enough small tensors for several buckets at the suite's 256-byte buffer."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {f"layer{i:02d}.w": torch.randn(9 + i, generator=g) for i in range(24)}
    state["layer99.b"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    return state


class EngineContractSuite:
    """Behaviour every engine pair must show."""

    #: The worker engine's registry name.
    backend: ClassVar[str] = ""
    timeout_s: ClassVar[float] = 30.0
    device: ClassVar[str] = "cpu"

    pytestmark = [pytest.mark.timeout(120)]

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> TrainerInitInfo:
        """A fresh trainer init info (rank 0) for ``num_workers`` receivers."""
        raise NotImplementedError

    @contextmanager
    def source_for(self, state: Mapping[str, torch.Tensor]) -> Iterator[WeightSource]:
        """The trainer's source over ``state``; override to keep the weights where the engine
        treats them specially (shared memory, a device). It must follow in-place changes."""
        yield TensorSource(state)

    @contextmanager
    def pair(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        num_workers: int = 1,
        buffer_size_bytes: int = 1 << 20,
        sink_factory: Callable[[torch.nn.Module], WeightSink] = ModuleSink,
    ) -> Iterator[Pair]:
        modules = [build_module(zeros_like_state(state)) for _ in range(num_workers)]
        workers = [
            WeightSyncWorker(
                self.backend, sink_factory(m), device=self.device, rank=i, world_size=num_workers
            )
            for i, m in enumerate(modules)
        ]
        client = RecordingClient(InProcessClient(workers, timeout_s=self.timeout_s))
        trainer = None
        try:
            with self.source_for(state) as source:
                info = self.make_trainer_init_info(
                    num_workers=num_workers, buffer_size_bytes=buffer_size_bytes
                )
                trainer = WeightTransferTrainerFactory.trainer_init(
                    info, client=client, source=source
                )
                yield Pair(trainer, workers, modules, client)
        finally:
            if trainer is not None:
                trainer.shutdown()
            for w in workers:
                w.shutdown()

    def test_roundtrip_mixed_dtypes(self) -> None:
        state = mixed_dtype_state(seed=1)
        with self.pair(state) as p:
            stats = p.trainer.send_weights(weight_version="v1")
            assert_state_equal(p.modules[0], state)
            assert stats.num_tensors == len(state)
            assert stats.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
            assert p.client.calls[-1] == ("finish_weight_update", "v1")  # the caller's version

    def test_zero_dim_and_empty_tensors(self) -> None:
        import torch

        state = {
            "a.scalar": torch.tensor(3.5),
            "b.empty": torch.empty(0, 4, dtype=torch.bfloat16),
            "c.scalar_int": torch.tensor(-7, dtype=torch.int64),
            "d.empty_bool": torch.empty(0, dtype=torch.bool),
        }
        with self.pair(state) as p:
            p.trainer.send_weights(weight_version="v1")
            assert_state_equal(p.modules[0], state)

    def test_non_contiguous_tensors(self) -> None:
        import torch

        base = torch.arange(15, dtype=torch.float32).reshape(5, 3)
        wide = torch.arange(40, dtype=torch.float16).reshape(4, 10)
        state = {"t.transposed": base.t(), "s.strided": wide[:, ::2]}
        assert not state["t.transposed"].is_contiguous()
        with self.pair(state) as p:
            p.trainer.send_weights(weight_version="v1")
            assert_state_equal(p.modules[0], {k: v.contiguous() for k, v in state.items()})

    def test_many_buckets(self) -> None:
        import torch

        g = torch.Generator().manual_seed(3)
        state = {f"layer{i}.w": torch.randn(7 + i, generator=g) for i in range(40)}
        state["huge.w"] = torch.randn(2048, generator=g)  # larger than the buffer
        with self.pair(state, buffer_size_bytes=256) as p:
            p.trainer.send_weights(weight_version="v1")
            assert_state_equal(p.modules[0], state)

    def test_repeated_rounds_publish_version(self) -> None:
        state = mixed_dtype_state(seed=2)
        with self.pair(state) as p:
            for step in range(3):
                _bump(state)
                info_before = p.workers[0].weight_info()
                p.trainer.send_weights(weight_version=f"step-{step}")
                assert_state_equal(p.modules[0], state)
                info = p.workers[0].weight_info()
                assert info["weight_version"] == f"step-{step}"
                assert info["consistent"] is True
                assert info["rounds_ok"] == info_before["rounds_ok"] + 1

    def test_two_workers(self) -> None:
        state = mixed_dtype_state(seed=4)
        with self.pair(state, num_workers=2) as p:
            for step in range(2):
                p.trainer.send_weights(weight_version=f"s{step}")
                for m, w in zip(p.modules, p.workers, strict=True):
                    assert_state_equal(m, state)
                    assert w.weight_info()["weight_version"] == f"s{step}"

    def test_empty_model(self) -> None:
        # A round that would change no weight publishes nothing: refused before it starts.
        with self.pair({}) as p:
            with pytest.raises(PayloadError, match="no tensors"):
                p.trainer.send_weights(weight_version="empty")
            info = p.workers[0].weight_info()
            assert (info["weight_version"], info["state"], info["consistent"]) == (
                None,
                "idle",
                True,
            )

    def test_payloads_are_json(self) -> None:
        state = mixed_dtype_state(seed=5)
        with self.pair(state) as p:
            p.trainer.send_weights(weight_version="v1")
            names = p.client.names()
            assert names[0] == "init_weight_transfer_engine"
            assert names[1] == "start_weight_update" and names[-1] == "finish_weight_update"
            assert "update_weights" in names

    @pytest.mark.parametrize("kind", MISMATCH_KINDS)
    def test_metadata_mismatch_raises(self, kind: str) -> None:
        state = mixed_dtype_state(seed=6)
        with self.pair(state) as p:
            p.trainer.send_weights(weight_version="good")
            bad: WeightSource = MismatchedSource(TensorSource(state), kind)
            with pytest.raises(PayloadError, match="metadata"):
                p.trainer.send_weights(bad, weight_version="bad")
            for w in p.workers:
                assert w.weight_info()["weight_version"] == "good"

    def test_sink_rejection_raises_without_hanging(self) -> None:
        state = mixed_dtype_state(seed=7)
        with self.pair(state, sink_factory=lambda m: _RejectingSink()) as p:
            with pytest.raises(Exception, match="sink rejects"):
                p.trainer.send_weights(weight_version="v1")
            info = p.workers[0].weight_info()
            assert info["weight_version"] is None
            assert info["consistent"] is False

    def _assert_honest(
        self, p: Pair, published: str, old: Mapping[str, torch.Tensor], *, failed: list[int]
    ) -> None:
        """After a failed round: nothing new published, never a mixed model called consistent."""
        import torch

        for i, (m, w) in enumerate(zip(p.modules, p.workers, strict=True)):
            info = w.weight_info()
            assert info["weight_version"] == published, (i, info)
            held = dict(m.named_parameters())
            untouched = all(torch.equal(held[n].detach(), t) for n, t in old.items())
            if not untouched:
                assert info["consistent"] is False, f"receiver {i} is mixed but says consistent"
            if i in failed:
                assert info["consistent"] is False, (i, info)

    def _assert_recovered(self, p: Pair, state: Mapping[str, torch.Tensor], version: str) -> None:
        _bump(state)
        p.trainer.send_weights(weight_version=version)
        for m, w in zip(p.modules, p.workers, strict=True):
            assert_state_equal(m, state)
            info = w.weight_info()
            assert (info["weight_version"], info["consistent"], info["state"]) == (
                version,
                True,
                "idle",
            ), info

    def test_recovers_after_one_receivers_sink_fails(self) -> None:
        """Two receivers; B's sink fails mid-round after both applied a bucket."""
        state = _many_bucket_state(seed=11)
        sinks: list[SwitchableSink] = []

        def make_sink(m: torch.nn.Module) -> WeightSink:
            sinks.append(SwitchableSink(m))
            return sinks[-1]

        with self.pair(state, num_workers=2, buffer_size_bytes=256, sink_factory=make_sink) as p:
            p.trainer.send_weights(weight_version="v1")
            old = {n: t.clone() for n, t in state.items()}
            _bump(state)
            sinks[1].fail_after(1)
            with pytest.raises(Exception):  # noqa: B017 - how it surfaces is the engine's
                p.trainer.send_weights(weight_version="v2")
            self._assert_honest(p, "v1", old, failed=[1])
            sinks[1].heal()
            self._assert_recovered(p, state, "v3")

    @pytest.mark.parametrize("kind", ["reshaped", "missing"])
    def test_recovers_after_mismatch_mid_round(self, kind: str) -> None:
        """Two receivers; the source breaks its metadata after some buckets went out."""
        state = _many_bucket_state(seed=12)
        with self.pair(state, num_workers=2, buffer_size_bytes=256) as p:
            p.trainer.send_weights(weight_version="v1")
            old = {n: t.clone() for n, t in state.items()}
            _bump(state)
            bad: WeightSource = MismatchedSource(TensorSource(state), kind)
            with pytest.raises(PayloadError, match="metadata"):
                p.trainer.send_weights(bad, weight_version="bad")
            self._assert_honest(p, "v1", old, failed=[])
            self._assert_recovered(p, state, "v2")

    def test_recovers_after_one_receiver_rejects_start(self) -> None:
        """Two receivers; B is left in a stray round, so it rejects the trainer's start."""
        state = mixed_dtype_state(seed=13)
        with self.pair(state, num_workers=2) as p:
            p.trainer.send_weights(weight_version="v1")
            old = {n: t.clone() for n, t in state.items()}
            p.workers[1].start_weight_update()  # a stray round, e.g. a crashed trainer's
            _bump(state)
            with pytest.raises(Exception):  # noqa: B017 - how it surfaces is the engine's
                p.trainer.send_weights(weight_version="v2")
            self._assert_honest(p, "v1", old, failed=[])
            self._assert_recovered(p, state, "v3")
