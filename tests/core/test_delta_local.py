"""The delta-round suite on the built-in ``local`` engine pair."""

from __future__ import annotations

from wtcore.local import LocalTrainerInitInfo
from wtcore.testing.delta import DeltaContractSuite


class TestLocalDelta(DeltaContractSuite):
    backend = "local"

    def make_trainer_init_info(
        self, *, num_workers: int, buffer_size_bytes: int
    ) -> LocalTrainerInitInfo:
        return LocalTrainerInitInfo(packed_buffer_size_bytes=buffer_size_bytes, rank=0)


def test_dense_tensor_refreshes_its_base_ever_less_often() -> None:
    # A tensor that changes entirely every round is sent whole; its base copy is refreshed
    # after 0, 1, 3 rounds... (not every round), and what the trainer would resend (the base
    # source) is always the new weights, bit for bit.
    import torch

    from wtcore.delta.codec import bits
    from wtcore.delta.trainer import DeltaReport, DeltaTracker
    from wtcore.source import TensorSource
    from wtcore.testing.delta import assert_bits_equal

    t = torch.randn(100_000).to(torch.bfloat16)
    tracker = DeltaTracker()
    list(tracker.refreshing(TensorSource({"w": t})))
    tracker.commit("v0")
    stored = []
    for r in range(10):
        b = bits(t)
        b.copy_(b ^ 1)
        report = DeltaReport()
        tracker.encode(TensorSource({"w": t}), report)
        assert report.tensors["full"] == 1
        assert_bits_equal(dict(tracker.base_source()), {"w": t})
        tracker.commit(f"v{r + 1}")
        stored.append(tracker._base["w"] is not None)
    assert stored == [False, True, False, False, True, False, False, False, False, True]
