"""The ``ray_object_store`` peer of ``wtcore bench --baselines peers``, on the session cluster.

Skipped where Ray is not installed. It must move the model exactly (``torch.equal`` on every
tensor of every receiver) and leave a cluster it did not start running.
"""

from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the Ray object-store peer needs ray")

import torch  # noqa: E402

from wtcore_bench import BaselineContext  # noqa: E402
from wtcore_kit.synthetic import synthetic_state  # noqa: E402

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


def test_object_store_peer_moves_the_model_bit_exact(ray_cluster: Any) -> None:
    from wtcore_bench.support.ray_peer import object_store_run

    state = synthetic_state(2 << 20, 30, "bfloat16", seed=5)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ctx = BaselineContext(state, nbytes, 2, timeout_s=120)
    gbps, models = object_store_run(ctx, repeats=1, bucket_bytes=256 << 10, send_models=True)
    assert gbps > 0 and len(models) == 2
    for model in models:
        for name, want in state.items():
            assert model[name].dtype == want.dtype and torch.equal(model[name], want), name
    assert ray.is_initialized(), "the peer shut down a cluster it did not start"


def test_the_client_declares_the_peer() -> None:
    from wtcore_bench.support import client_bench

    baselines = client_bench("ray").baselines
    assert baselines["ray_object_store"].peer is True
    assert baselines["ray_object_store"].devices == ("cpu",)
