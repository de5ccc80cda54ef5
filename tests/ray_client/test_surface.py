"""The Ray client on the one client surface: both protocols, the shared shapes, and a stuck
actor as a ``TimeoutError`` (the same class as in process and over HTTP)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from wtcore import (
    InspectableClient,
    ReceiverError,
    ReceiverTimeoutError,
    TensorSource,
    WeightSyncClient,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_ray_client import launch_receivers

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(120)]

SEED = 11


def test_both_protocols_and_the_shared_shapes(ray_cluster: None, kit: Any) -> None:
    state = kit.make_state(SEED)
    sink = functools.partial(kit.module_sink, SEED)
    with launch_receivers(2, "inline", sink, num_cpus=0, max_concurrency=4) as group:
        client = group.client(timeout_s=30.0)
        assert isinstance(client, WeightSyncClient) and isinstance(client, InspectableClient)
        engine = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0), client=client
        )
        engine.send_weights(TensorSource(state), weight_version="r1", verify=True)
        infos = client.weight_info()
        assert [(i["rank"], i["weight_version"]) for i in infos] == [(0, "r1"), (1, "r1")]
        assert client.checksums() == [digest_named(state.items())] * 2
        assert client.get_world_size() == 2
        client.start_weight_update()
        client.abort_weight_update("operator said so")
        assert [i["state"] for i in client.weight_info()] == ["idle", "idle"]
        client.close()  # the actors keep running: the group owns them
        assert [i["weight_version"] for i in client.weight_info()] == ["r1", "r1"]


def test_a_stuck_actor_is_a_timeout_error(ray_cluster: None, kit: Any) -> None:
    state = kit.make_state(SEED)
    sink = functools.partial(kit.BlockingSink, SEED, 30.0)
    with launch_receivers(1, "inline", sink, num_cpus=0, max_concurrency=4) as group:
        engine = WeightTransferTrainerFactory.trainer_init(
            InlineTrainerInitInfo(rank=0), client=group.client(timeout_s=2.0)
        )
        with pytest.raises(TimeoutError) as err:
            engine.send_weights(TensorSource(state), weight_version="r2")
    assert isinstance(err.value, ReceiverTimeoutError) and isinstance(err.value, ReceiverError)
    assert err.value.call == "update_weights"
    assert [f.receiver for f in err.value.failures] == group.labels
