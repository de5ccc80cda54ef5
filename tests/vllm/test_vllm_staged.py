"""Staged rounds into a real vLLM server: it serves the old weights, bit for bit, until the commit.

One server of checkpoint A with ``wtcore_inline`` and the worker extension (its
``wtcore_weight_info``); the trainer is wtcore's ``inline`` engine in this process, through
``HTTPWeightSyncClient``, with ``staged=True``. A classic round of B (the path
``test_vllm_e2e.py`` checks against a reference server) gives B's outputs and checksums. At the
prepare of a staged round every byte is staged, and the server still generates and checksums
the old weights; after the commit it holds the new ones exactly, paused for the commit only.
A fleet of that server and a ``wtcore serve --transactional`` receiver, the latter SIGKILLed at
the prepare: the trainer's error names it, and the vLLM server keeps the old weights and version;
the next trainer's round (a fresh receiver in place of the dead one) commits on both.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.vllm.conftest import Checkpoint
from tests.vllm.vllm_kit import Outputs, VLLMServer, generate, servers
from wtcore import ReceiverError, TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.rounds import PREPARE_KEY
from wtcore_bench.serve import ServeProcess, launch_serve
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Weights:
    state: dict[str, torch.Tensor]  # what the trainer sends
    outputs: Outputs  # what the server generates with them
    checksums: dict[str, str]  # vLLM's checksums of them (kernel format)


@dataclass(frozen=True)
class Staged:
    server: VLLMServer
    a: Weights
    b: Weights
    ckpt_a: Checkpoint


class _AtPrepare(HTTPWeightSyncClient):
    """Runs ``before()`` when the round's prepare goes out (every byte staged), then sends it."""

    before: Callable[[], None] = staticmethod(lambda: None)

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, dict) and PREPARE_KEY in update_info:
            self.before()
        super().update_weights(update_info)


def _send(urls: list[str], state: Any, version: str, *, staged: bool, client: Any = None) -> None:
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=64 << 10, staged=staged)
    with (
        client or HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as c,
        WeightTransferTrainerFactory.trainer_init(info, client=c) as trainer,
    ):
        trainer.send_weights(TensorSource(state), weight_version=version)


def _fresh(server: VLLMServer) -> Outputs:
    """Greedy outputs, after dropping KV cached with earlier weights (a commit keeps it)."""
    assert server.post("/reset_prefix_cache") == {"success": True}
    return generate(server)


def _round_times(server: VLLMServer) -> dict[str, Any]:
    (times,) = server.post("/collective_rpc", {"method": "wtcore_weight_info"})["results"]
    return {k: times[k] for k in ("staged_s", "commit_s", "paused_s")}


def _serving(server: VLLMServer, w: Weights, version: str) -> None:
    assert server.weight_version() == version
    assert server.checksums() == w.checksums  # every weight, bit for bit
    assert _fresh(server) == w.outputs  # token ids and logprobs, exactly


@pytest.fixture(scope="module")
def staged_server(
    checkpoints: tuple[Checkpoint, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Staged]:
    ckpt_a = checkpoints[0]
    extra = ["--worker-extension-cls", "wtcore_vllm.extension.WtcoreWorkerExtension"]
    log = tmp_path_factory.mktemp("vllm-staged-logs") / "a-inline.log"
    with servers([(ckpt_a.dir, log, "wtcore_inline")], extra=extra) as (server,):
        state_a, state_b = (torch.load(c.state, weights_only=True) for c in checkpoints)
        a = Weights(state_a, generate(server), server.checksums())
        server.post("/pause")  # a classic round: the server is no version until its finish
        try:
            _send([server.url], state_b, "classic-b", staged=False)
        finally:
            server.post("/resume")
        times = _round_times(server)
        assert times["staged_s"] is None and times["paused_s"] >= times["commit_s"] > 0
        b = Weights(state_b, generate(server), server.checksums())
        assert b.outputs != a.outputs and b.checksums != a.checksums
        yield Staged(server, a, b, ckpt_a)


def _at(s: Staged, w: Weights, version: str) -> None:
    """Put the server on ``w`` (a staged round, unless it holds ``w`` already)."""
    if s.server.checksums() != w.checksums:
        _send([s.server.url], w.state, version, staged=True)
    _serving(s.server, w, s.server.weight_version())


def test_a_staged_round_serves_the_old_weights_until_its_commit(staged_server: Staged) -> None:
    s = staged_server
    _at(s, s.b, "at-b")
    old = s.server.weight_version()
    seen: list[str] = []

    def still_old() -> None:  # every byte of A is staged, no update is refused: still B
        _serving(s.server, s.b, old)
        seen.append("prepare")

    client = _AtPrepare([s.server.url], timeout_s=TIMEOUT_S)
    client.before = still_old
    _send([s.server.url], s.a.state, "staged-a", staged=True, client=client)
    assert seen == ["prepare"]
    _serving(s.server, s.a, "staged-a")
    times = _round_times(s.server)
    assert times["paused_s"] == times["commit_s"] and times["staged_s"] > 0, times

    _send([s.server.url], s.b.state, "staged-b", staged=True)  # and back, exactly
    _serving(s.server, s.b, "staged-b")


def test_a_receiver_killed_at_the_prepare_leaves_vllm_on_the_old_weights(
    staged_server: Staged, tmp_path: Any
) -> None:
    s = staged_server
    _at(s, s.b, "at-b")
    old = s.server.weight_version()
    args = ["--transactional", "--safetensors", str(s.ckpt_a.dir / "model.safetensors")]
    started: list[ServeProcess] = []
    try:
        doomed = launch_serve(args, workdir=tmp_path, via_cli=False)
        started.append(doomed)
        urls = [s.server.url, doomed.url]
        client = _AtPrepare(urls, timeout_s=TIMEOUT_S)
        client.before = lambda: doomed.stop(signal.SIGKILL, timeout_s=10)
        with pytest.raises(ReceiverError) as err:
            _send(urls, s.a.state, "never", staged=True, client=client)
        assert err.value.call == "update_weights"
        assert [f.receiver for f in err.value.failures] == [doomed.url], str(err.value)
        # vLLM staged and prepared all of A, committed nothing: B, bit for bit, its version.
        _serving(s.server, s.b, old)
        # The next trainer's init abandons vLLM's prepared round; its round commits on both.
        fresh = launch_serve(args, workdir=tmp_path, via_cli=False)
        started.append(fresh)
        _send([s.server.url, fresh.url], s.a.state, "fleet-a", staged=True)
        _serving(s.server, s.a, "fleet-a")
        with HTTPWeightSyncClient([fresh.url], timeout_s=TIMEOUT_S) as c:
            assert c.checksums() == [digest_named(s.a.state.items())]
    finally:
        for p in started:
            p.stop(timeout_s=10)
