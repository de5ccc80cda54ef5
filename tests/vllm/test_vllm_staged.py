"""Staged rounds into a real vLLM server: it serves the old weights, bit for bit, until the commit.

One server of checkpoint A with ``wtcore_inline`` and the worker extension (its
``wtcore_weight_info``), compiled as users' servers are (the other fixtures start eager), so
the compiled model is shown to run both kinds of round, judged by its own outputs. The trainer
is wtcore's ``inline`` engine in this process, through ``HTTPWeightSyncClient``, with
``staged=True``. A classic round of B (the path
``test_vllm_e2e.py`` checks against a reference server) gives B's outputs and checksums. At the
prepare of a staged round every byte is staged, and the server still generates and checksums
the old weights; after the commit it holds the new ones exactly, paused for the commit only.
A fleet of that server and a ``wtcore serve --transactional`` receiver, the latter SIGKILLed at
the prepare: the trainer's error names it, and the vLLM server keeps the old weights and version;
the next trainer's round (a fresh receiver in place of the dead one) commits on both.

On the session's ``wtcore_nccl`` server and the tied fixture's ``wtcore_ipc`` one, a staged
round receives off vLLM's engine loop: the server generates while the round's receive waits for
bytes the trainer sends only once it did.
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import torch

from tests.vllm.conftest import Checkpoint, Servers
from tests.vllm.vllm_kit import Outputs, VLLMServer, generate, nccl_trainer_info, servers
from wtcore import ReceiverError, TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.rounds import PREPARE_KEY
from wtcore_bench.serve import ServeProcess, launch_serve
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_ipc import IPCTrainerInitInfo
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
    with servers([(ckpt_a.dir, log, "wtcore_inline")], extra=extra, compiled=True) as (server,):
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
    times = _round_times(s.server)  # paused: the commit, and the round's calls into vLLM
    assert times["paused_s"] >= times["commit_s"] > 0 and times["staged_s"] > 0, times

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


def _nccl_send(source: Any, version: str, client: Any) -> None:
    info = nccl_trainer_info(timeout_s=TIMEOUT_S, staged=True)
    with client, WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer:
        trainer.send_weights(source, weight_version=version)


def _ipc_send(source: Any, version: str, client: Any) -> None:
    info = IPCTrainerInitInfo(rank=0, timeout_s=TIMEOUT_S, share_weights=False, staged=True)
    with client, WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer:
        trainer.send_weights(source, weight_version=version)


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_vllm_generates_while_a_staged_round_receives(
    request: pytest.FixtureRequest, backend: str
) -> None:
    """nccl: its updates return at once; ipc: its ring's one update returns at once (the
    trainer picks the ring from the source's first tensor, so the wait comes after it)."""
    if backend == "nccl":
        s: Servers = request.getfixturevalue("vllm_servers")
        server, send, held_at = s.a, _nccl_send, 0
    else:  # the tied fixture's server of A on wtcore_ipc
        s = request.getfixturevalue("tied_servers")
        assert s.ipc is not None
        server, send, held_at = s.ipc, _ipc_send, 1
    generated: list[Outputs] = []
    answered = threading.Event()

    class GeneratesAfterUpdate(HTTPWeightSyncClient):
        def update_weights(self, update_info: Any) -> None:
            super().update_weights(update_info)  # the round's announcement: returns at once
            if PREPARE_KEY not in update_info:
                generated.append(_fresh(server))
                answered.set()

    class AfterGeneration(TensorSource):
        """B's tensors, from the ``held_at``-th on only once vLLM generated: till then vLLM
        waits for bytes."""

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(super().__iter__()):
                if i == held_at:
                    assert answered.wait(TIMEOUT_S), "vLLM generated nothing while it received"
                yield item

    state_a, state_b = (torch.load(c.state, weights_only=True) for c in (s.ckpt_a, s.ckpt_b))
    try:
        client = GeneratesAfterUpdate([server.url], timeout_s=TIMEOUT_S)
        send(AfterGeneration(state_b), f"staged-{backend}-b", client)
        assert generated == [s.original]  # A, while B was being received
        assert server.weight_version() == f"staged-{backend}-b"
        assert server.checksums() == s.ref.checksums()  # B, bit for bit
        assert _fresh(server) == s.reference
    finally:  # back to A, for the session's other tests
        client = HTTPWeightSyncClient([server.url], timeout_s=TIMEOUT_S)
        send(TensorSource(state_a), f"staged-{backend}-a", client)
    assert _fresh(server) == s.original


@dataclass
class Streamed:
    tokens: list[int]
    finish_reason: str | None
    weight_versions: list[dict[str, Any]] | None


def _stream(url: str, started: threading.Event, out: list[Streamed]) -> None:
    """One greedy request of 120 tokens through vLLM's token route; ``started`` once the first
    came."""
    params = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    body = {"token_ids": [5, 6, 7], "sampling_params": params, "stream": True}
    got = Streamed([], None, None)
    with requests.post(url + "/inference/v1/generate", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            (choice,) = json.loads(line[6:])["choices"]
            got.tokens += choice.get("token_ids") or []
            got.finish_reason = choice.get("finish_reason") or got.finish_reason
            got.weight_versions = choice.get("weight_versions") or got.weight_versions
            started.set()
    out.append(got)


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_commit_pause_settles_the_requests_in_flight(vllm_servers: Servers, mode: str) -> None:
    """A request streams from before the commit's pause. Whether vLLM had finished it by then is
    up to the machine; either way every token labelled with the old version is A's, and the
    new label starts where the commit came."""
    s = vllm_servers
    old, new = s.a.weight_version(), f"paused-{mode}"
    reference: list[Streamed] = []
    _stream(s.a.url, threading.Event(), reference)
    (ref,) = reference
    assert len(ref.tokens) == 120 and ref.weight_versions == [
        {"version": old, "start": 0, "end": 120}
    ]
    started, streamed = threading.Event(), []
    streamer = threading.Thread(target=_stream, args=(s.a.url, started, streamed))

    class StreamsBeforePause(HTTPWeightSyncClient):  # every byte staged and prepared
        def pause(self, mode: str = "abort", *, clear_cache: bool | None = None) -> None:
            streamer.start()
            assert started.wait(TIMEOUT_S)
            super().pause(mode, clear_cache=clear_cache)

    state_a, state_b = (torch.load(c.state, weights_only=True) for c in (s.ckpt_a, s.ckpt_b))
    try:
        client = StreamsBeforePause([s.a.url], timeout_s=TIMEOUT_S, commit_pause=mode)
        _nccl_send(TensorSource(state_b), new, client)
        streamer.join(TIMEOUT_S)
        (got,) = streamed
        assert s.a.weight_version() == new
        assert s.a.checksums() == s.ref.checksums()
        spans = got.weight_versions or []
        assert [(v["start"], v["end"]) for v in spans] == list(
            itertools.pairwise([0, *(v["end"] for v in spans)])
        ), spans  # contiguous, over every token
        assert spans[-1]["end"] == len(got.tokens) > 0
        assert [v["version"] for v in spans] in ([old], [old, new]), spans
        for v in spans:  # the old label on A's tokens only
            if v["version"] == old:
                assert got.tokens[v["start"] : v["end"]] == ref.tokens[v["start"] : v["end"]]
        if mode == "wait":  # all of it on A, before the commit
            assert got.tokens == ref.tokens and spans == ref.weight_versions
        elif mode == "abort":  # cut at the commit, unless it had ended
            assert got.finish_reason == "abort" or got.tokens == ref.tokens, got
        else:  # frozen at the commit, then on to its end with B
            assert got.finish_reason == "length" and len(got.tokens) == 120, got
        assert generate(s.a) == s.reference  # the pause dropped the cache: B's outputs exactly
    finally:
        if streamer.ident is not None:
            streamer.join(TIMEOUT_S)
        _nccl_send(TensorSource(state_a), "paused-back-to-a", HTTPWeightSyncClient([s.a.url]))
    assert _fresh(s.a) == s.original
