"""Honest state inside vLLM: an owned round refuses another trainer's update, and publishes
nothing when it fails.

vLLM's routes drop wtcore's round header, so a wtcore trainer also stamps its round's id into
every ``update_info`` (``wtcore.rounds.ROUND_KEY``) and the adapter binds the round to its first
update's id. Here the trainer is wtcore's ``nccl`` engine in this process, against the shared
``wtcore_nccl`` server of A. Between its update and its finish a second client posts an update
of its own: one stamped with another round's id (a second wtcore trainer), one with none (a
vLLM-style client). Each is refused with the adapter's error, vLLM ends the round, the owner's
finish fails, and ``/weight_info`` keeps the last finished version. Fresh rounds then restore
the exact outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests
import torch

from tests.vllm.vllm_kit import VLLMServer, generate, nccl_trainer_info, run_trainer
from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.errors import ReceiverError
from wtcore.rounds import ROUND_KEY, new_round_id
from wtcore_http_client import HTTPWeightSyncClient

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

EMPTY = {"names": [], "dtype_names": [], "shapes": []}


class IntrudedClient(HTTPWeightSyncClient):
    """The owner's client; ``intrude`` runs between its round's last update and its finish."""

    intrude: Callable[[], None] = staticmethod(lambda: None)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.intrude()
        super().finish_weight_update(weight_version)


def owned_round_with_an_intruder(
    server: VLLMServer, state: Any, intruder_body: dict[str, Any]
) -> tuple[str, str]:
    """One owned round that a second client breaks into; returns (intruder's answer, owner's error)."""
    answers: list[str] = []

    def intrude() -> None:
        r = requests.post(server.url + "/update_weights", json=intruder_body, timeout=120)
        answers.append(f"{r.status_code} {r.text}")

    info = nccl_trainer_info(timeout_s=120.0)
    source = TensorSource(torch.load(state, weights_only=True))
    with IntrudedClient(server.url, timeout_s=120) as client:
        client.intrude = intrude
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        try:
            with pytest.raises(ReceiverError) as failed:
                trainer.send_weights(weight_version="never")
        finally:
            trainer.shutdown()
    return answers[0], str(failed.value)


@pytest.mark.parametrize(
    ("stamp", "says"),
    [(new_round_id(), "carries another round's id"), (None, "carries no round id")],
    ids=["second-trainer", "vllm-style-client"],
)
def test_an_update_from_anyone_but_the_owner_is_refused_and_nothing_is_published(  # type: ignore[no-untyped-def]
    vllm_servers, stamp: str | None, says: str
) -> None:
    s = vllm_servers
    before = s.a.weight_version()
    body: dict[str, Any] = {"update_info": {**EMPTY, **({ROUND_KEY: stamp} if stamp else {})}}
    s.a.post("/pause")
    try:
        intruder, owner = owned_round_with_an_intruder(s.a, s.ckpt_b.state, body)
    finally:
        s.a.post("/resume")
    assert intruder.startswith("500 "), intruder
    assert f"refused, this is an owned round and the update {says}" in intruder
    assert "finish_weight_update" in owner  # vLLM ended the round: the owner's finish fails
    assert s.a.weight_version() == before  # nothing published
    assert len(generate(s.a)) == len(s.original)  # still serving

    for state, version, want in (
        (s.ckpt_b.state, "owned-b", s.reference),
        (s.ckpt_a.state, "owned-a", s.original),
    ):
        s.a.post("/pause")
        try:
            run_trainer(s.a.url, state, version)
        finally:
            s.a.post("/resume")
        assert s.a.weight_version() == version
        assert generate(s.a) == want
