"""The issue-8 fault matrix rows not covered by a plugin's own tests, with real processes.

Receivers are ``wtcore serve`` processes (started with ``launch_serve``, always stopped by PID);
the trainer runs in this process, or in a child process for "trainer killed". Every test
asserts: the error arrives within the timeout and names what failed; each receiver's
``weight_info()`` tells the truth; the weights are the old version, the new one, or reported
inconsistent; no process or port is left behind; and the next init or round works without
restarting the survivors. ``docs/reliability.md`` ("Fault matrix") lists every row and where
the other rows are tested.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import (
    ReceiverError,
    TensorSource,
    TransferTimeoutError,
    WeightTransferTrainerFactory,
)
from wtcore.digest import digest_named
from wtcore.meta import ParamMeta
from wtcore.source import WeightSource
from wtcore.testing import MismatchedSource, free_port, wait_until
from wtcore.testing.procs import freeze, stop_processes
from wtcore.testing.sources import synthetic_state
from wtcore_bench.serve import ServeProcess, launch_serve
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.inline import InlineTrainerInitInfo
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_tcp import TCPTrainerInitInfo

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180), pytest.mark.slow]

SIZE, TENSORS = 64 << 10, 12
TIMEOUT_S = 6.0  # the engine's bound on rendezvous and broadcasts, and the HTTP client's
SLACK_S = 6.0  # fan-out grace plus a busy 2-core machine
NCCL_OPTS = '{"torch_num_threads": 1}'


def state_of(seed: int) -> dict[str, torch.Tensor]:
    return synthetic_state(SIZE, TENSORS, "float32", seed=seed)


def info_of(server: ServeProcess) -> dict[str, Any]:
    with HTTPWeightSyncClient(server.url, timeout_s=30) as c:
        [info] = c.weight_info()
    return info  # type: ignore[no-any-return]


def checksums_of(server: ServeProcess) -> dict[str, str]:
    with HTTPWeightSyncClient(server.url, timeout_s=30) as c:
        [sums] = c.checksums()
    return sums  # type: ignore[no-any-return]


def port_is_free(port: int) -> bool:
    """Nobody listens on ``port`` (closed connections may linger in TIME_WAIT: allowed)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., list[Any]]]:
    """``launch(args, args, ...)`` starts receivers in parallel; all are stopped at the end."""
    tmp = tmp_path_factory.mktemp("receivers")
    started: list[ServeProcess] = []

    def start(*arg_lists: list[str]) -> list[ServeProcess]:
        with ThreadPoolExecutor(len(arg_lists)) as pool:
            servers = list(pool.map(lambda a: launch_serve(a, workdir=tmp), arg_lists))
        started.extend(servers)
        return servers

    try:
        yield start
    finally:
        for server in started:
            server.stop(timeout_s=10)
        left = [s.pid for s in started if s.proc.poll() is None]
        assert not left, f"receiver processes left behind: {left}"


def nccl_args(rank: int, world_size: int = 2, engine: str = "nccl") -> list[str]:
    """A receiver's arguments; ``engine="tcp"``: a tcp receiver (it takes no options)."""
    options = ["--backend-options", NCCL_OPTS] if engine == "nccl" else []
    return [
        "--backend", engine, *options, "--rank", str(rank),
        "--world-size", str(world_size), "--size", str(SIZE), "--tensors", str(TENSORS),
    ]  # fmt: skip


def nccl_info(world_size: int, port: int | None = None) -> NCCLTrainerInitInfo:
    return NCCLTrainerInitInfo(
        rank=0,
        master_address="127.0.0.1",
        master_port=port or free_port(),
        world_size=world_size,
        packed_buffer_size_bytes=16 << 10,
        timeout_s=TIMEOUT_S,
        torch_num_threads=1,
    )


def info_of_engine(
    engine: str, world_size: int, port: int | None = None
) -> NCCLTrainerInitInfo | TCPTrainerInitInfo:
    """nccl's init info, or tcp's (its chain for two receivers, on ``port``)."""
    if engine == "nccl":
        return nccl_info(world_size, port)
    return TCPTrainerInitInfo(
        rank=0, address="127.0.0.1", port=port or free_port(), world_size=world_size,
        packed_buffer_size_bytes=16 << 10, timeout_s=TIMEOUT_S,
    )  # fmt: skip


def sync(
    client: HTTPWeightSyncClient, state: dict[str, torch.Tensor], version: str, engine: str = "nccl"
) -> None:
    """One round from a fresh trainer (a new group) to the receiver behind ``client``."""
    info = info_of_engine(engine, 2)
    with WeightTransferTrainerFactory.trainer_init(info, client=client) as trainer:
        trainer.send_weights(TensorSource(state), weight_version=version)


@pytest.fixture(scope="module", params=["nccl", "tcp"])
def survivor(
    launch: Callable[..., list[ServeProcess]], request: pytest.FixtureRequest
) -> tuple[str, ServeProcess]:
    """Rank 0 of a 2-receiver fleet, reused by every "receiver killed" test: nccl (gloo's
    collective) or tcp (its chain: rank 0 relays to the victim)."""
    [server] = launch(nccl_args(0, engine=request.param))
    return request.param, server


# ---------------------------------------------------------------------- receiver killed
class SabotagingClient:
    """Forwards to an HTTP client; freezes and then kills ``victim`` during call ``phase``.

    The victim is stopped (SIGSTOP) just before the call goes out, so the request reaches a
    process that cannot answer, and killed (SIGKILL) ``delay_s`` later: it dies *during* the
    call, wherever the call is in the victim's kernel buffers or handler.
    """

    def __init__(self, inner: HTTPWeightSyncClient, victim: ServeProcess, phase: str) -> None:
        self.inner, self.victim, self.phase = inner, victim, phase
        self.killer: threading.Timer | None = None

    def _maybe_sabotage(self, call: str) -> None:
        if call == self.phase and self.killer is None:
            freeze(self.victim.pid)
            self.killer = threading.Timer(0.5, self._kill)
            self.killer.start()

    def _kill(self) -> None:
        os.kill(self.victim.pid, signal.SIGKILL)  # no SIGCONT first: it must not answer
        self.victim.proc.wait(10)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._maybe_sabotage("init")
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._maybe_sabotage("start")
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self._maybe_sabotage("update")
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._maybe_sabotage("finish")
        self.inner.finish_weight_update(weight_version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


#: phase -> the client call named in the error
KILL_PHASES = {
    "init": "init_weight_transfer_engine",
    "start": "start_weight_update",
    "update": "update_weights",
    "finish": "finish_weight_update",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", sorted(KILL_PHASES))
def test_receiver_killed_during(
    launch: Callable[..., list[ServeProcess]], survivor: tuple[str, ServeProcess], phase: str
) -> None:
    """nccl or tcp engine over HTTP, two receivers; rank 1 dies during ``phase``."""
    engine, server = survivor
    [victim] = launch(nccl_args(1, engine=engine))
    old, new = state_of(1), state_of(2)
    port = free_port()
    urls = [server.url, victim.url]
    with HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as http:
        client = SabotagingClient(http, victim, phase)
        trainer = None
        t0 = time.monotonic()
        try:
            if phase != "init":
                trainer = WeightTransferTrainerFactory.trainer_init(
                    info_of_engine(engine, 3, port), client=http
                )
                trainer.send_weights(TensorSource(old), weight_version="old")
                trainer.client = client  # the next round goes through the saboteur
                t0 = time.monotonic()
            # During init both sides time out together (the survivor waits in the
            # rendezvous for the dead rank): either the fan-out's ReceiverError or the
            # trainer's own TransferTimeoutError, naming the missing rank, arrives first.
            expected = (ReceiverError, TransferTimeoutError) if phase == "init" else ReceiverError
            with pytest.raises(expected) as err:
                if trainer is None:
                    WeightTransferTrainerFactory.trainer_init(
                        info_of_engine(engine, 3, port), client=client
                    )
                else:
                    trainer.send_weights(TensorSource(new), weight_version="new")
            elapsed = time.monotonic() - t0
        finally:
            if client.killer is not None:
                client.killer.join()
            if trainer is not None:
                trainer.shutdown()
    assert elapsed < TIMEOUT_S + SLACK_S, f"{elapsed:.1f} s"
    message = str(err.value)
    if isinstance(err.value, ReceiverError):
        assert victim.url in {f.receiver for f in err.value.failures}, message
        assert err.value.call == KILL_PHASES[phase], message
    else:
        assert "ranks [2] never" in message, message  # nccl: "never did"; tcp: "never opened"
    del err, trainer, client  # the traceback's frames hold the trainer's group and store
    gc.collect()
    assert victim.proc.poll() is not None
    print(f"{phase}: {elapsed:.1f} s: {message}")

    # The survivor's report is true, once its own side of the round has ended (its
    # broadcast partner died, so its data-plane call ends within the engine's timeout).
    wait_until(lambda: info_of(server)["busy"] is None, TIMEOUT_S + SLACK_S, "survivor idle")
    info = info_of(server)
    held = checksums_of(server)
    if phase == "init":
        assert info["state"] == "uninitialized" and "init_weight_transfer_engine" in (
            info["last_error"] or ""
        )
    elif phase == "finish":
        # the survivor finished: it holds and publishes the new version, consistently
        assert (info["weight_version"], info["consistent"]) == ("new", True)
        assert held == digest_named(new.items())
    else:
        assert info["weight_version"] == "old"
        if info["consistent"]:
            assert held == digest_named(old.items())  # untouched
        # else: reported mixed, which is the truth a non-transactional receiver can tell
    assert port_is_free(port), "the trainer's rendezvous port is still bound"

    # Recovery without restarting the survivor: a new group of the trainer and the survivor.
    with HTTPWeightSyncClient(server.url, timeout_s=TIMEOUT_S) as alone:
        sync(alone, state_of(3), f"after-{phase}", engine)
    info = info_of(server)
    assert (info["weight_version"], info["consistent"]) == (f"after-{phase}", True)
    assert checksums_of(server) == digest_named(state_of(3).items())


# ---------------------------------------------------------------------- trainer killed
TRAINER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from wtcore import TensorSource, WeightTransferTrainerFactory
    from wtcore.testing.sources import synthetic_state
    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_nccl import NCCLTrainerInitInfo

    url, port, size, tensors, timeout_s = sys.argv[1:6]

    class Stalling(TensorSource):
        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if i == int(tensors) // 2:
                    print("mid-round", flush=True)
                    time.sleep(600)  # the parent kills this process here
                yield item

    info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=int(port),
                               world_size=2, packed_buffer_size_bytes=4096,
                               timeout_s=float(timeout_s), torch_num_threads=1)
    client = HTTPWeightSyncClient(url, timeout_s=float(timeout_s) * 4)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
    trainer.send_weights(Stalling(synthetic_state(int(size), int(tensors), "float32", seed=8)))
    """
)


@pytest.mark.timeout(120)
def test_trainer_killed_mid_round(launch: Callable[..., list[ServeProcess]]) -> None:
    """An nccl trainer process dies (SIGKILL) mid-broadcast; the receiver notices within its
    timeout, reports the round failed, and a new trainer syncs it without a restart."""
    [receiver] = launch(nccl_args(0, world_size=1))
    with HTTPWeightSyncClient(receiver.url, timeout_s=30) as c:  # a known first version
        sync(c, state_of(1), "old")
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-c", TRAINER_SCRIPT, receiver.url, str(port), str(SIZE),
         str(TENSORS), str(TIMEOUT_S)],
        stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "mid-round", f"trainer rc={child.poll()}"
        wait_until(
            lambda: info_of(receiver)["busy"] == "update_weights", 30, "the receiver's update"
        )
        child.kill()
        child.wait(10)
        t0 = time.monotonic()
        wait_until(
            lambda: info_of(receiver)["busy"] is None, TIMEOUT_S + SLACK_S, "the update to end"
        )
        print(f"receiver noticed after {time.monotonic() - t0:.1f} s")
    finally:
        stop_processes([child], 0.0)  # SIGKILL if it still runs, and reap it
        if child.stdout is not None:
            child.stdout.close()
    info = info_of(receiver)
    assert info["state"] == "idle" and info["weight_version"] == "old"
    assert info["consistent"] is False, info  # half a round may have landed
    assert "update_weights" in info["last_error"], info
    assert port_is_free(port)
    with HTTPWeightSyncClient(receiver.url, timeout_s=30) as c:
        sync(c, state_of(4), "recovered")
    assert info_of(receiver)["consistent"] is True
    assert checksums_of(receiver) == digest_named(state_of(4).items())


# ---------------------------------------------------------------------- two trainers
class GatedSource(WeightSource):
    """Yields ``inner``'s tensors but waits at item ``at`` until ``go`` is set."""

    def __init__(self, inner: WeightSource, at: int) -> None:
        self.inner, self.at = inner, at
        self.paused, self.go = threading.Event(), threading.Event()

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.at:
                self.paused.set()
                assert self.go.wait(60)
            yield item


def local_args(*extra: str) -> list[str]:
    return ["--size", str(SIZE), "--tensors", str(TENSORS), "--world-size", "2", *extra]


@pytest.fixture(scope="module")
def local_pair(launch: Callable[..., list[ServeProcess]]) -> list[ServeProcess]:
    return launch(local_args("--rank", "0"), local_args("--rank", "1"))


def local_trainer(client: HTTPWeightSyncClient) -> Any:
    info = InlineTrainerInitInfo(rank=0, packed_buffer_size_bytes=8 << 10)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


@pytest.mark.timeout(120)
def test_two_trainers_at_once(local_pair: list[ServeProcess]) -> None:
    """Both trainers initialized; while A's round runs, B's round is refused (409) at start,
    changes nothing, and A's round completes."""
    urls = [s.url for s in local_pair]
    first, second = state_of(5), state_of(6)
    with (
        HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as ca,
        HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as cb,
    ):
        a, b = local_trainer(ca), local_trainer(cb)
        gated = GatedSource(TensorSource(first), at=TENSORS // 2)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(a.send_weights, gated, weight_version="a")
            assert gated.paused.wait(30)
            t0 = time.monotonic()
            with pytest.raises(ReceiverError) as err:
                b.send_weights(TensorSource(second), weight_version="b")
            assert time.monotonic() - t0 < TIMEOUT_S
            gated.go.set()
            running.result(60)
    assert err.value.call == "start_weight_update"
    assert {f.status for f in err.value.failures} == {409}
    assert len(err.value.failures) == 2
    assert "a round is already in progress" in str(err.value)
    for server in local_pair:
        info = info_of(server)
        assert (info["weight_version"], info["consistent"], info["state"]) == ("a", True, "idle")
        assert checksums_of(server) == digest_named(first.items())


@contextlib.contextmanager
def trainer_a_and_client_b(
    servers: list[ServeProcess],
) -> Iterator[tuple[Any, HTTPWeightSyncClient]]:
    """Trainer A, synced to version ``base``, and a second client B for the same receivers."""
    urls = [s.url for s in servers]
    with (
        HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as ca,
        HTTPWeightSyncClient(urls, timeout_s=TIMEOUT_S) as cb,
    ):
        a = local_trainer(ca)
        a.send_weights(TensorSource(state_of(5)), weight_version="base")
        yield a, cb


@pytest.mark.timeout(120)
def test_second_trainer_init_abandons_the_round(local_pair: list[ServeProcess]) -> None:
    """A second trainer's *init* during a round is not refused: re-init is how a trainer
    recovers from a failed round, so it abandons the open round. The first trainer then fails
    with a clear 409, nothing is published, and the receivers say their weights may be
    mixed until the next round completes."""
    with trainer_a_and_client_b(local_pair) as (a, cb):
        gated = GatedSource(TensorSource(state_of(7)), at=TENSORS // 2)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(a.send_weights, gated, weight_version="a2")
            assert gated.paused.wait(30)
            b = local_trainer(cb)  # init is admitted and abandons a's round
            gated.go.set()
            with pytest.raises(ReceiverError) as err:
                running.result(60)
        assert err.value.call == "update_weights" and err.value.failures[0].status == 409
        # Depending on whether a's update was already running when b's init came, the init
        # preempted it or it arrived at a closed round; both say who ended the round.
        message = str(err.value)
        assert (
            "round is no longer open" in message and "abandoned by a new init" in message
        ) or "preempted by a later init_weight_transfer_engine" in message, message
        for server in local_pair:
            info = info_of(server)
            assert (info["weight_version"], info["consistent"]) == ("base", False)
        b.send_weights(TensorSource(state_of(9)), weight_version="b")
    for server in local_pair:
        info = info_of(server)
        assert (info["weight_version"], info["consistent"]) == ("b", True)


@pytest.mark.timeout(180)
def test_second_trainer_round_inside_the_first_is_never_mixed(
    local_pair: list[ServeProcess],
) -> None:
    """A starts and updates; B inits, starts and updates; then A carries on. Every call of A
    is refused (409: its round is no longer open), nothing of A's is applied after B's init,
    and B's round publishes exactly B's weights, consistent."""
    with trainer_a_and_client_b(local_pair) as (a, cb):
        gated_a = GatedSource(TensorSource(state_of(7)), at=TENSORS // 2)
        gated_b = GatedSource(TensorSource(state_of(9)), at=TENSORS // 2)
        with ThreadPoolExecutor(2) as pool:
            running_a = pool.submit(a.send_weights, gated_a, weight_version="a2")
            assert gated_a.paused.wait(30)
            b = local_trainer(cb)
            running_b = pool.submit(b.send_weights, gated_b, weight_version="b")
            assert gated_b.paused.wait(30)  # B's round is open, with updates applied
            gated_a.go.set()
            with pytest.raises(ReceiverError) as err:
                running_a.result(60)
            for server in local_pair:  # A did not disturb B's open round
                assert info_of(server)["state"] == "updating"
            gated_b.go.set()
            running_b.result(60)
        assert err.value.call == "update_weights"
        assert {f.status for f in err.value.failures} == {409}
        # Refused between calls ("no longer open"), or, when one of A's calls was still
        # running as B's init arrived (a loaded machine), preempted by it: both publish nothing.
        assert re.search(
            r"no longer open|preempted by a later init_weight_transfer_engine", str(err.value)
        )
    for server in local_pair:
        info = info_of(server)
        assert (info["weight_version"], info["consistent"], info["state"]) == ("b", True, "idle")
        assert checksums_of(server) == digest_named(state_of(9).items())


# ---------------------------------------------------------------------- NaN/Inf, transactional
@pytest.fixture(scope="module")
def guarded(launch: Callable[..., list[ServeProcess]]) -> dict[str, ServeProcess]:
    """One receiver with --reject-nonfinite, one with --transactional as well."""
    one = ["--size", str(SIZE), "--tensors", str(TENSORS), "--reject-nonfinite"]
    plain, transactional = launch(one, [*one, "--transactional"])
    return {"plain": plain, "transactional": transactional}


def poisoned(seed: int, value: float) -> dict[str, torch.Tensor]:
    state = state_of(seed)
    last = list(state)[-1]
    state[last] = state[last].clone()
    state[last].view(-1)[3] = value
    return state


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("mode", ["plain", "transactional"])
def test_nonfinite_rejected_over_http(
    guarded: dict[str, ServeProcess], mode: str, value: float
) -> None:
    server = guarded[mode]
    good = state_of(11)
    with HTTPWeightSyncClient(server.url, timeout_s=TIMEOUT_S) as c:
        trainer = local_trainer(c)
        trainer.send_weights(TensorSource(good), weight_version="good")
        t0 = time.monotonic()
        with pytest.raises(ReceiverError) as err:
            trainer.send_weights(TensorSource(poisoned(12, value)), weight_version="poisoned")
        assert time.monotonic() - t0 < TIMEOUT_S
        assert err.value.call == "update_weights" and err.value.failures[0].status == 400
        assert "rejected non-finite weights (NaN or Inf)" in str(err.value)
        assert repr(list(good)[-1]) in str(err.value)  # names the tensor
        info = info_of(server)
        assert info["weight_version"] == "good" and info["state"] == "idle"
        held = checksums_of(server)
        if mode == "transactional":
            # the old weights keep serving, untouched, and the receiver says so
            assert info["consistent"] is True and held == digest_named(good.items())
        else:
            # earlier buckets of the round were loaded: reported, not hidden
            assert info["consistent"] is False and held != digest_named(good.items())
        assert not any(torch.isfinite(torch.tensor([value])))
        # the next round works without a restart
        trainer.send_weights(TensorSource(state_of(13)), weight_version="next")
    info = info_of(server)
    assert (info["weight_version"], info["consistent"]) == ("next", True)
    assert checksums_of(server) == digest_named(state_of(13).items())


@pytest.mark.timeout(120)
def test_transactional_trainer_side_failure_keeps_old_weights(
    guarded: dict[str, ServeProcess],
) -> None:
    """A round the trainer abandons half-way (its source breaks its metadata promise) and then
    re-inits: the transactional receiver still serves the old weights and stays consistent."""
    server = guarded["transactional"]
    good = state_of(21)
    with HTTPWeightSyncClient(server.url, timeout_s=TIMEOUT_S) as c:
        trainer = local_trainer(c)
        trainer.send_weights(TensorSource(good), weight_version="good")
        with pytest.raises(Exception, match="metadata") as err:
            trainer.send_weights(
                MismatchedSource(TensorSource(state_of(22)), "reshaped"), weight_version="bad"
            )
        print(type(err.value).__name__, err.value)
        local_trainer(c)  # re-init: abandons whatever the receiver still has open
        info = info_of(server)
        assert (info["weight_version"], info["consistent"]) == ("good", True)
        assert checksums_of(server) == digest_named(good.items())


def test_no_receiver_left_behind(launch: Callable[..., list[ServeProcess]]) -> None:
    """Runs last in this module: every receiver it started is stopped in the fixture's
    finalizer, which asserts that no PID is left (see ``launch``)."""
    assert Path("/proc").exists()
