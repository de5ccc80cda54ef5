"""End to end over a real local Ray cluster: a trainer in the driver, receivers in actors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from wtcore import CLIENTS, ENGINES, TRAINER_ENGINES, ReceiverError, TensorSource, WeightSyncClient
from wtcore.config import build_client, trainer_from_config
from wtcore.digest import digest_named
from wtcore.testing import RecordingClient, free_port
from wtcore_ray_client import RayWeightSyncClient, launch_receivers

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(120)]

SEED = 3


def bump(state: dict[str, torch.Tensor], step: int) -> None:
    """A training step: change every tensor, differently each step."""
    for t in state.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.numel():
            t.add_(step + 1)


def _installed(backend: str) -> bool:
    return backend in ENGINES.names() and backend in TRAINER_ENGINES.names()


#: Engines that fit a trainer in the driver and receivers in actors on the same node, with a
#: small buffer so that each round takes several ``update_weights`` calls (buckets).
BACKENDS = {
    "inline": {"packed_buffer_size_bytes": 8 << 10},
    "ipc": {"packed_buffer_size_bytes": 8 << 10, "device": "cpu", "timeout_s": 60},
    # gloo on CPU; the driver is rank 0 and hosts the rendezvous, the actors are ranks 1, 2.
    "nccl": {"packed_buffer_size_bytes": 8 << 10, "world_size": 3, "timeout_s": 60},
}


def _config(backend: str) -> dict[str, Any]:
    import ray

    config = {"backend": backend, **BACKENDS[backend]}
    if backend == "nccl":
        # The multi-node recipe (docs/ray.md): the trainer node's IP as Ray sees it.
        config["master_address"] = ray.util.get_node_ip_address()
        config["master_port"] = free_port()
    return config


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_two_actors_several_rounds(ray_cluster: None, kit: Any, backend: str) -> None:
    """The receivers are the user's own actor class with WeightSyncActor mixed in."""
    import ray

    if not _installed(backend):
        pytest.skip(f"wtcore-{backend} is not installed")
    state = kit.make_state(SEED)
    handles = [
        ray.remote(kit.InferenceActor)
        .options(num_cpus=0, max_concurrency=4)
        .remote(SEED + 50, backend, rank=i, world_size=2)
        for i in range(2)
    ]
    try:
        client = RecordingClient(RayWeightSyncClient(handles, timeout_s=60))
        assert isinstance(client.inner, WeightSyncClient)
        with trainer_from_config(
            _config(backend), client=client, source=TensorSource(state)
        ) as trainer:
            for step in range(3):
                bump(state, step)
                stats = trainer.send_weights(weight_version=f"step-{step}")
                assert stats.num_buckets > 1
                want = digest_named(state.items())
                assert client.inner.checksums() == [want, want]
                for h in handles:
                    held = kit.tensors_from_held(ray.get(h.held_tensors.remote(), timeout=30))
                    assert sorted(held) == sorted(state)
                    for name, t in state.items():
                        assert held[name].dtype == t.dtype, name
                        assert torch.equal(held[name], t), f"step {step}: {name} differs"
                infos = client.inner.weight_info()
                assert [i["weight_version"] for i in infos] == [f"step-{step}"] * 2
                assert all(i["consistent"] and i["state"] == "idle" for i in infos)
                assert [i["rank"] for i in infos] == [0, 1]
        names = client.names()
        assert names[0] == "init_weight_transfer_engine"
        assert names.count("finish_weight_update") == 3
    finally:
        for h in handles:
            ray.kill(h)


def test_launcher_ranks_identities_and_config_client(ray_cluster: None, kit: Any) -> None:

    state = kit.make_state(SEED)
    sink = functools.partial(kit.module_sink, SEED)
    with launch_receivers(
        2, "inline", sink, num_cpus=0, rank_offset=1, name_prefix="wtcore-e2e", namespace="wtcore-t"
    ) as group:
        assert group.ranks == [1, 2] and group.worker_ranks == [0, 1]
        assert group.names == ["wtcore-e2e-0", "wtcore-e2e-1"]
        idents = group.client().identities()
        assert [i["rank"] for i in idents] == [0, 1]
        assert [i["name"] for i in idents] == group.names
        assert all(i["world_size"] == 2 and i["backend"] == "inline" for i in idents)
        assert len({i["pid"] for i in idents}) == 2  # two actor processes
        assert all(i["node_ip"] for i in idents)

        # The ``ray`` client by name, from a config dict (as a JSON/TOML file would give it).
        assert CLIENTS.load("ray") is RayWeightSyncClient
        config = {
            "backend": "inline",
            "packed_buffer_size_bytes": 1 << 20,
            "client": {
                "name": "ray",
                "handles": group.names,
                "namespace": "wtcore-t",
                "timeout_s": 60,
            },
        }
        with trainer_from_config(config, source=TensorSource(state)) as trainer:
            trainer.send_weights(weight_version="v1")
            assert isinstance(trainer.client, RayWeightSyncClient)
        want = digest_named(state.items())
        assert group.client().checksums() == [want, want]
        assert [i["weight_version"] for i in group.client().weight_info()] == ["v1", "v1"]
    # Shut down on exit: the actors are gone.
    with pytest.raises(ReceiverError) as ei:
        RayWeightSyncClient(group.handles, timeout_s=10).weight_info()
    assert len(ei.value.failures) == 2
    assert all(f.error_type == "ActorDiedError" for f in ei.value.failures)
    with pytest.raises(ValueError, match="no Ray actor named 'wtcore-e2e-0'"):
        build_client({"name": "ray", "handles": ["wtcore-e2e-0"], "namespace": "wtcore-t"})
