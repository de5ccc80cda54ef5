"""Failures over Ray: a killed actor, a stuck actor, a misconfigured sink, bad calls.

Each one must reach the trainer as one :class:`wtcore.ReceiverError` naming the failing actor,
within the client's timeout, while the healthy actors report their state correctly.
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from wtcore import PayloadError, ReceiverError, TensorSource
from wtcore.buckets import max_bucket_nbytes, pack_source, plan_buckets
from wtcore.config import trainer_from_config
from wtcore.digest import digest_named
from wtcore.factory import WeightTransferTrainerFactory
from wtcore.meta import metas_to_wire
from wtcore.stats import TransferStats
from wtcore.testing import KillingSource, free_port
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_ray_client import RayWeightSyncClient, launch_receivers

pytestmark = [
    pytest.mark.processes,
    pytest.mark.ray,
    pytest.mark.timeout(300),
]  # Ray and torch start slowly under load

SEED = 5


def _killer(actor: Any) -> Callable[[], None]:
    """Kill ``actor`` for good (a crash mid-round), for :class:`wtcore.testing.KillingSource`."""

    def kill() -> None:
        import ray

        ray.kill(actor, no_restart=True)

    return kill


def test_actor_killed_mid_round(ray_cluster: None, kit: Any) -> None:
    state = kit.make_state(SEED)
    sink = functools.partial(kit.module_sink, SEED)
    with launch_receivers(2, "inline", sink, num_cpus=0, name_prefix="wtcore-kill") as group:
        timeout_s = 20.0
        client = group.client(timeout_s=timeout_s)
        info = InlineTrainerInitInfo(packed_buffer_size_bytes=4 << 10, rank=0)
        with WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer:
            trainer.send_weights(TensorSource(state), weight_version="good")
            victim = group.handles[1]
            victim_client = RayWeightSyncClient([victim], timeout_s=timeout_s)
            t0 = time.monotonic()
            with pytest.raises(ReceiverError) as ei:
                trainer.send_weights(
                    KillingSource(
                        TensorSource(state),
                        _killer(victim),
                        at=5,
                        once=lambda: victim_client.weight_info()[0]["state"] == "updating",
                    ),
                    weight_version="bad",
                )
            assert time.monotonic() - t0 < timeout_s
        err = ei.value
        assert err.call == "update_weights" and err.total == 2
        [failure] = err.failures  # only the killed actor failed
        assert failure.receiver == group.labels[1]
        assert "rank=2" in failure.receiver and "name=wtcore-kill-1" in failure.receiver
        assert failure.error_type == "ActorDiedError"
        assert "ray.kill" in failure.message
        assert "wtcore-kill-1" in str(err)

        # The survivor: the trainer aborted the failed round there, so it still serves the
        # last published version and says its weights may be mixed ...
        survivor = RayWeightSyncClient(group.handles[:1], timeout_s=timeout_s)
        [s] = survivor.weight_info()
        assert s["weight_version"] == "good" and s["rounds_ok"] == 1
        assert s["state"] == "idle" and s["consistent"] is False and s["busy"] is None
        assert "abort_weight_update" in s["last_error"] and "wtcore-kill-1" in s["last_error"]
        # ... until a full round to the survivors publishes again.
        with WeightTransferTrainerFactory.trainer_init(info, client=survivor) as trainer:
            trainer.send_weights(TensorSource(state), weight_version="recovered")
        [s] = survivor.weight_info()
        assert s["weight_version"] == "recovered" and s["consistent"] is True
        assert survivor.checksums() == [digest_named(state.items())]


def test_stuck_actor_times_out_and_still_answers(ray_cluster: None, kit: Any) -> None:
    """A load that hangs costs one timeout; the threaded actor still reports it is busy."""
    state = kit.make_state(SEED)
    sink = functools.partial(kit.BlockingSink, SEED, 60.0)
    with launch_receivers(1, "inline", sink, num_cpus=0, max_concurrency=4) as group:
        client = group.client(timeout_s=3.0)
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 20})
        client.start_weight_update()
        payload = _local_payload(state)
        t0 = time.monotonic()
        with pytest.raises(ReceiverError) as ei:
            client.update_weights(payload)
        elapsed = time.monotonic() - t0
        assert 3.0 <= elapsed < 15.0
        assert ei.value.timed_out
        assert ei.value.failures[0].receiver == group.labels[0]
        assert "no answer within 3 s" in str(ei.value)
        # weight_info is not blocked by the running update (max_concurrency > 1).
        t0 = time.monotonic()
        [info] = group.client(timeout_s=5.0).weight_info()
        assert time.monotonic() - t0 < 5.0
        assert info["busy"] == "update_weights" and info["state"] == "updating"
        # An overlapping protocol call is refused by the core worker's rules.
        with pytest.raises(ReceiverError, match="rejected, update_weights is still running"):
            client.finish_weight_update("v1")


def _local_payload(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One ``inline``-engine bucket holding all of ``state`` (what its trainer would send)."""
    src = TensorSource(state)
    metas = src.metadata()
    [bucket] = plan_buckets(metas, 1 << 20)
    staging = torch.empty(max_bucket_nbytes([bucket]), dtype=torch.uint8)
    [(_, filled)] = list(pack_source(src, metas, [bucket], lambda _b: staging, TransferStats()))
    data = base64.b64encode(filled.numpy().tobytes()).decode("ascii")
    return {**metas_to_wire(bucket.metas), "data": data}


def test_misconfigured_sink_error_reaches_trainer(ray_cluster: None, kit: Any) -> None:
    """Actor rank=2's model lacks a parameter: the trainer learns which actor and which name."""
    state = kit.make_state(SEED)
    missing = "layers.3.weight"
    good = functools.partial(kit.module_sink, SEED)
    bad = functools.partial(kit.module_sink, SEED, missing)
    with (
        launch_receivers(2, "inline", good, num_cpus=0) as ok_group,
        launch_receivers(1, "inline", bad, num_cpus=0, rank_offset=3) as bad_group,
    ):
        handles = ok_group.handles + bad_group.handles
        labels = ok_group.labels + bad_group.labels
        # World size 1 per launch is fine for the inline engine: it sends one dict to all.
        client = RayWeightSyncClient(handles, timeout_s=30, labels=labels)
        info = InlineTrainerInitInfo(packed_buffer_size_bytes=1 << 20, rank=0)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
        with trainer, pytest.raises(ReceiverError) as ei:
            trainer.send_weights(TensorSource(state), weight_version="v1")
        [failure] = ei.value.failures
        assert failure.receiver == bad_group.labels[0] and "rank=3" in failure.receiver
        assert failure.error_type == "PayloadError"
        assert f"{missing!r}: unknown parameter name" in failure.message
        assert "Traceback" not in str(ei.value)  # the cause, not Ray's remote traceback
        infos = client.weight_info()
        # The trainer aborted the round everywhere: the healthy actors loaded a bucket of a
        # round that was never finished, so none of them reads as consistent.
        assert [(i["state"], i["consistent"]) for i in infos] == [("idle", False)] * 3
        assert all("abort_weight_update" in i["last_error"] for i in infos[:2])
        assert missing in infos[2]["last_error"]
        assert all(i["weight_version"] is None for i in infos)


def test_bad_calls_are_named_errors(ray_cluster: None, kit: Any) -> None:
    sink = functools.partial(kit.module_sink, SEED)
    with launch_receivers(2, "inline", sink, num_cpus=0) as group:
        client = group.client(timeout_s=30)
        # Out of order: both actors refuse, each named, with the core worker's message.
        with pytest.raises(ReceiverError) as ei:
            client.start_weight_update()
        assert [f.receiver for f in ei.value.failures] == group.labels
        assert all(f.error_type == "ProtocolStateError" for f in ei.value.failures)
        assert "call init_weight_transfer_engine first" in str(ei.value)
        # A malformed init payload: the field is named.
        with pytest.raises(ReceiverError, match="packed_buffer_size_bytes") as ei:
            client.init_weight_transfer_engine({"packed_buffer_size_bytes": "big"})
        assert {f.error_type for f in ei.value.failures} == {"PayloadError"}
        # Not JSON: refused in the driver, before anything is sent.
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 20})
        client.start_weight_update()
        with pytest.raises(PayloadError, match=r"update_info\['data'\].*torch\.Tensor"):
            client.update_weights(
                {"names": [], "dtype_names": [], "shapes": [], "data": torch.zeros(1)}
            )
        with pytest.raises(PayloadError, match="a list of 1 entries does not split evenly over 2"):
            client.update_weights([{}])
        assert [i["state"] for i in client.weight_info()] == ["updating", "updating"]


def test_broken_sink_factory_fails_at_launch(ray_cluster: None) -> None:
    def no_model() -> Any:
        raise RuntimeError("model weights not found at /models/x")

    with pytest.raises(ReceiverError) as ei:
        launch_receivers(2, "inline", no_model, num_cpus=0, ready_timeout_s=60)
    assert len(ei.value.failures) == 2
    assert all(f.error_type == "ActorDiedError" for f in ei.value.failures)
    assert all(
        f.message == "the actor's constructor failed: "
        "RuntimeError: model weights not found at /models/x"
        for f in ei.value.failures
    )


def test_actor_killed_mid_broadcast_nccl_engine(ray_cluster: None, kit: Any) -> None:
    """The gloo group loses a peer mid-round: the trainer learns it at once, naming the actor."""
    import ray

    from wtcore import ENGINES

    if "nccl" not in ENGINES.names():
        pytest.skip("wtcore-nccl is not installed")
    state = kit.make_state(SEED)
    sink = functools.partial(kit.module_sink, SEED)
    with launch_receivers(2, "nccl", sink, num_cpus=0, name_prefix="wtcore-nkill") as group:
        timeout_s = 30.0
        config: dict[str, Any] = {
            "backend": "nccl",
            "master_address": ray.util.get_node_ip_address(),
            "master_port": free_port(),
            "world_size": 1 + len(group),
            "packed_buffer_size_bytes": 4 << 10,
            "timeout_s": 15,
        }
        with trainer_from_config(config, client=group.client(timeout_s=timeout_s)) as trainer:
            trainer.send_weights(TensorSource(state), weight_version="good")
            t0 = time.monotonic()
            with pytest.raises(ReceiverError) as ei:
                trainer.send_weights(
                    KillingSource(
                        TensorSource(kit.make_state(SEED + 1)), _killer(group.handles[1]), at=5
                    ),
                    weight_version="bad",
                )
            assert time.monotonic() - t0 < timeout_s
        by_actor = {f.receiver: f for f in ei.value.failures}
        victim = by_actor[group.labels[1]]
        assert victim.error_type == "ActorDiedError" and "ray.kill" in victim.message
        assert "name=wtcore-nkill-1" in victim.receiver
        # The survivor lost its round (the broadcast broke) and keeps "good". Whether it is
        # consistent depends on timing, never on luck: on a loaded machine the trainer's abort
        # can reach the survivor before its update call ran, and then nothing was written.
        survivor = RayWeightSyncClient(group.handles[:1], timeout_s=timeout_s)
        [s] = survivor.weight_info()
        assert s["weight_version"] == "good" and s["state"] == "idle"
        if s["consistent"]:
            assert survivor.checksums() == [digest_named(state.items())]
        # Recovery: a new transfer group over the survivor alone.
        config.update(world_size=2, master_port=free_port())
        with trainer_from_config(config, client=survivor) as trainer:
            trainer.send_weights(TensorSource(state), weight_version="recovered")
        [s] = survivor.weight_info()
        assert s["weight_version"] == "recovered" and s["consistent"] is True
        assert survivor.checksums() == [digest_named(state.items())]


def test_one_failure_cuts_the_wait_for_the_others(ray_cluster: None, kit: Any) -> None:
    """One actor rejects at once, one hangs: the trainer hears both after fail_fast_s."""
    state = kit.make_state(SEED)
    stuck = functools.partial(kit.BlockingSink, SEED, 60.0)
    bad = functools.partial(kit.module_sink, SEED, "layers.0.weight")
    with (
        launch_receivers(1, "inline", stuck, num_cpus=0) as g1,
        launch_receivers(1, "inline", bad, num_cpus=0, rank_offset=2) as g2,
    ):
        client = RayWeightSyncClient(
            g1.handles + g2.handles, timeout_s=60, labels=g1.labels + g2.labels, fail_fast_s=1.0
        )
        client.init_weight_transfer_engine({"packed_buffer_size_bytes": 1 << 20})
        client.start_weight_update()
        t0 = time.monotonic()
        with pytest.raises(ReceiverError) as ei:
            client.update_weights(_local_payload(state))
        assert time.monotonic() - t0 < 20.0  # far below the 60 s timeout
        hung, rejected = ei.value.failures
        assert rejected.receiver == g2.labels[0] and rejected.error_type == "PayloadError"
        assert "'layers.0.weight': unknown parameter name" in rejected.message
        assert hung.receiver == g1.labels[0] and hung.error_type == "TransferTimeoutError"
        assert f"still running 1 s after {g2.labels[0]} failed" in hung.message


def test_actors_that_require_round_ids(ray_cluster: None, kit: Any) -> None:
    # worker_options reach each actor's WeightSyncWorker: an id-less call (a vLLM-style client
    # calling the actor directly) is refused naming the option; the Ray client's rounds pass.
    import ray

    sink = functools.partial(kit.module_sink, SEED)
    options = {"require_round_id": True}
    with launch_receivers(2, "inline", sink, num_cpus=0, worker_options=options) as group:
        with pytest.raises(ray.exceptions.RayTaskError, match="require_round_id"):
            ray.get(group.handles[0].init_weight_transfer_engine.remote({}), timeout=60)
        client = group.client(timeout_s=60)
        state = kit.make_state(SEED + 1)
        info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=1 << 20)
        with WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=TensorSource(state)
        ) as trainer:
            trainer.send_weights(weight_version="v1")
        assert client.checksums() == [digest_named(state.items())] * 2
        with pytest.raises(ray.exceptions.RayTaskError, match="start_weight_update.*require"):
            ray.get(group.handles[1].start_weight_update.remote(), timeout=60)
        infos = client.weight_info()
        assert [(i["weight_version"], i["state"]) for i in infos] == [("v1", "idle")] * 2
