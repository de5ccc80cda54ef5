"""Staged rounds across real `wtcore serve --transactional` receivers: all commit, or none.

Real server processes on 127.0.0.1 and real kills (a receiver between staging and the
prepare, a trainer process between the prepare and the commit).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from wtcore import ReceiverError, TensorSource, WeightTransferTrainerFactory
from wtcore.digest import digest_named
from wtcore.rounds import PREPARE_KEY
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.inline import InlineTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

SIZE, TENSORS = 64 << 10, 12
TIMEOUT_S = 20.0
ARGS = ("--size", str(SIZE), "--tensors", str(TENSORS), "--transactional")


def _state(seed: int) -> Any:
    return synthetic_state(SIZE, TENSORS, "float32", seed=seed)


def _info() -> InlineTrainerInitInfo:
    return InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=8 << 10, staged=True)


def _send(urls: list[str], state: Any, version: str) -> None:
    """One staged round from a fresh trainer (its init abandons any round left open)."""
    with (
        HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as client,
        WeightTransferTrainerFactory.trainer_init(_info(), client=client) as trainer,
    ):
        trainer.send_weights(TensorSource(state), weight_version=version)


def _assert_serving(urls: list[str], version: str, state: Any, round_state: str = "idle") -> None:
    with HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as client:
        for info in client.weight_info():
            assert (info["weight_version"], info["consistent"]) == (version, True), info
            assert info["state"] == round_state, info
        if round_state == "idle":  # checksums of an open staged round show what it would publish
            assert client.checksums() == [digest_named(state.items())] * len(urls)


class _KillAtPrepare(HTTPWeightSyncClient):
    """Kills ``victim`` (a real server process) once every byte of the round is staged."""

    victim: Any = None

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, dict) and PREPARE_KEY in update_info and self.victim:
            self.victim.stop(signal.SIGKILL)
        super().update_weights(update_info)


def test_a_receiver_lost_before_the_prepare_commits_no_one(start_server: Any) -> None:
    keep, doomed = start_server(*ARGS), start_server(*ARGS)
    v1 = _state(1)
    with (
        _KillAtPrepare([keep.url, doomed.url], timeout_s=TIMEOUT_S) as client,
        WeightTransferTrainerFactory.trainer_init(_info(), client=client) as trainer,
    ):
        trainer.send_weights(TensorSource(v1), weight_version="v1")
        client.victim = doomed
        with pytest.raises(ReceiverError) as err:
            trainer.send_weights(TensorSource(_state(2)), weight_version="v2")
    assert err.value.call == "update_weights"
    assert [f.receiver for f in err.value.failures] == [doomed.url], str(err.value)
    # The survivor staged all of v2 and prepared nothing: it still serves v1, consistent.
    _assert_serving([keep.url], "v1", v1)
    # The next round commits on both (the lost receiver replaced by a fresh one).
    fresh = start_server(*ARGS)
    v3 = _state(3)
    _send([keep.url, fresh.url], v3, "v3")
    _assert_serving([keep.url, fresh.url], "v3", v3)


TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    from wtcore import TensorSource, WeightTransferTrainerFactory
    from wtcore.testing.sources import synthetic_state
    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_kit.inline import InlineTrainerInitInfo

    class DiesBeforeCommit(HTTPWeightSyncClient):
        def finish_weight_update(self, weight_version=None):
            if weight_version == "v2":  # every receiver prepared v2: die before the commit
                os.kill(os.getpid(), signal.SIGKILL)
            super().finish_weight_update(weight_version)

    size, tensors, urls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=8 << 10, staged=True)
    client = DiesBeforeCommit(urls, timeout_s=20)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
    for seed, version in ((1, "v1"), (2, "v2")):
        state = synthetic_state(size, tensors, "float32", seed=seed)
        trainer.send_weights(TensorSource(state), weight_version=version)
    """
)


def test_a_trainer_killed_between_prepare_and_commit_commits_nothing(
    start_server: Any, tmp_path: Path
) -> None:
    fleet = [start_server(*ARGS) for _ in range(2)]
    urls = [s.url for s in fleet]
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), str(SIZE), str(TENSORS), *urls])
    try:
        assert proc.wait(timeout=120) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # Both receivers hold v2 prepared, uncommitted: they serve v1, consistent.
    _assert_serving(urls, "v1", _state(1), round_state="updating")
    # The next trainer's init abandons the prepared round; its own round commits everywhere.
    v3 = _state(3)
    _send(urls, v3, "v3")
    _assert_serving(urls, "v3", v3)
