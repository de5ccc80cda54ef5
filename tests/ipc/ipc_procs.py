"""Real worker and trainer processes for the ipc tests.

Run as a script: ``python ipc_procs.py worker --conn-fd FD [--die-at-update N]
[--hang-at-update N]`` serves a :class:`wtcore.WeightSyncWorker` (backend ``ipc``) on the
inherited socket ``FD`` with the shared pipe control plane of :mod:`wtcore.testing.pipes`
(JSON only, no pickle, as in production); ``python ipc_procs.py trainer SEED BUFFER ROUNDS
[--no-shutdown] [--die-after-tensors N] [--shared]`` runs an ipc trainer (``--shared``: over
shared weights) whose client writes each call to stdout and reads the answer from stdin, so
the test process relays (and can interfere). Imported by the tests (by path) for :class:`PipeWorker`, :class:`PipeClient` and :func:`make_state`.

Workers are started as scripts (not ``multiprocessing`` children) because this module is
loaded by path, which a ``spawn`` child could not import, and because the test needs their
PIDs for the leak check (which process still holds which segment).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import IO, Any

from wtcore.errors import ErrorRecord
from wtcore.testing import sources
from wtcore.testing.pipes import (
    PipeChannel,
    decode_state,
    encode_state,
    serve,
    worker_handlers,
)
from wtcore.testing.pipes import PipeClient as _FanOutClient
from wtcore.testing.procs import stop_processes

HERE = os.path.abspath(__file__)
#: PIDs of every process started here (for the leak check).
STARTED_PIDS: list[int] = [os.getpid()]
_MEMFD = "/memfd:"


def memfds_of(pid: int) -> set[str]:
    """The names of the wtcore memfds process ``pid`` holds, by descriptor or by mapping
    (nothing for a process that is gone: the kernel freed what it held)."""
    names: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return names
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    links += [line[line.index(_MEMFD) :] for line in maps if _MEMFD in line]
    for link in links:
        if link.startswith(_MEMFD + "wtcore_ipc_"):
            names.add(link[len(_MEMFD) :].removesuffix(" (deleted)").strip())
    return names


def reachable(name: str | None, fd: int | None = None) -> bool:
    """Whether a worker could still open segment ``name``: its creator (the pid its name
    carries) still holds a descriptor of it (``fd``, the announced one, or any: Python's
    ``mmap`` keeps a duplicate of the descriptor for as long as the mapping lives)."""
    if name is None:
        return False
    from wtcore_ipc.shm import segment_pid

    pid = segment_pid(name)
    try:
        fds = os.listdir(f"/proc/{pid}/fd") if fd is None else [str(fd)]
    except OSError:
        return False
    for n in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{n}") == f"{_MEMFD}{name} (deleted)":
                return True
        except OSError:
            pass
    return False


def our_segments(pids: list[int] | None = None) -> list[str]:
    """Segments created by any of ``pids`` (names carry the creator's PID) that a process
    started here (this one included) still holds, by descriptor or mapping: memory not freed.

    Only names with these PIDs are checked, so parallel test runs never see each other.
    """
    from wtcore_ipc.shm import segment_prefix

    prefixes = tuple(segment_prefix(p) for p in (STARTED_PIDS if pids is None else pids))
    held: set[str] = set()
    for pid in STARTED_PIDS:
        held |= memfds_of(pid)
    return sorted(n for n in held if n.startswith(prefixes))


# ---------------------------------------------------------------------- shared state
#: Mixed dtypes, many small layers and (with ``big``) one tensor of ``big`` float32s:
#: :func:`wtcore.testing.make_state`'s ``"layers"``.
make_state = functools.partial(sources.make_state, kind="layers")


def spec_of(state: Mapping[str, Any]) -> dict[str, Any]:
    from wtcore.meta import ParamMeta, metas_to_wire

    return metas_to_wire([ParamMeta.of(n, t) for n, t in state.items()])


# ---------------------------------------------------------------------- worker process
def worker_main(argv: list[str]) -> None:
    """Serve one (re-buildable) ipc worker on ``--conn-fd``; ``setup`` builds it for a model."""
    import torch

    from wtcore import ModuleSink, WeightSyncWorker
    from wtcore.meta import metas_from_wire
    from wtcore.testing import build_module

    torch.set_num_threads(1)
    die_at = int(argv[argv.index("--die-at-update") + 1]) if "--die-at-update" in argv else 0
    hang_at = int(argv[argv.index("--hang-at-update") + 1]) if "--hang-at-update" in argv else 0
    cut_at = (
        int(argv[argv.index("--truncate-at-tensor") + 1]) if "--truncate-at-tensor" in argv else -1
    )
    # Returns from each update at once, receiving on a thread (as vLLM's adapter does in a
    # staged round), and SIGKILLs itself when the copy reaches this tensor.
    flag = "--returns-first-dies-at-tensor"
    dies_at = int(argv[argv.index(flag) + 1]) if flag in argv else -1
    conn = Connection(int(argv[argv.index("--conn-fd") + 1]))
    held: dict[str, Any] = {"worker": None, "module": None, "updates": 0, "segment": None}
    held.update(segment_fd=None, truncation=None)

    class TruncatingSink(ModuleSink):
        """Has another process try to truncate the round's segment when the copy reaches
        tensor ``cut_at`` (keeping the control area and the first slot header): what a hostile
        or broken peer could do to shared memory at any moment. What that process got (0, or
        the errno of its refusal) is kept for the ``truncation`` call."""

        offered = 0

        def _count(self) -> None:
            """One more tensor reaches this sink; at ``cut_at``, before it is copied, cut."""
            if self.offered == dies_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.offered == cut_at:
                from wtcore_ipc.shm import CONTROL_BYTES, HEADER_BYTES, segment_pid

                path = f"/proc/{segment_pid(held['segment'])}/fd/{held['segment_fd']}"
                cut = (
                    "import os, sys\n"
                    "try:\n    os.truncate(sys.argv[1], int(sys.argv[2]))\n"
                    "except OSError as e:\n    print(e.errno)\nelse:\n    print(0)"
                )
                keep = str(CONTROL_BYTES + HEADER_BYTES)
                done = subprocess.run(
                    [sys.executable, "-c", cut, path, keep],
                    check=True,
                    timeout=60,
                    capture_output=True,
                    text=True,
                )
                held["truncation"] = int(done.stdout.strip())
            self.offered += 1

        def destination(self, name: str, dtype: Any, shape: tuple[int, ...]) -> Any:
            self._count()
            return super().destination(name, dtype, shape)

        def load_weights(self, weights: Any) -> None:
            batch = list(weights)
            for _ in batch:
                self._count()
            super().load_weights(batch)

    def current() -> WeightSyncWorker:
        assert held["worker"] is not None, "call setup first"
        worker: WeightSyncWorker = held["worker"]
        return worker

    def setup(
        spec: dict[str, Any], rank: int, world: int, device: str, round_timeout_s: float = 0
    ) -> None:
        if held["worker"] is not None:
            held["worker"].shutdown()
        metas = metas_from_wire(spec["names"], spec["dtype_names"], spec["shapes"])
        module = build_module({m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas})
        module.to(device)
        held["module"] = module
        held["worker"] = WeightSyncWorker(
            "ipc",
            (TruncatingSink if max(cut_at, dies_at) >= 0 else ModuleSink)(module),
            device=device,
            rank=rank,
            world_size=world,
            **({"round_timeout_s": round_timeout_s} if round_timeout_s else {}),
        )

    def update_weights(update_info: Any, round_id: str | None = None) -> None:
        held["updates"] += 1
        if held["updates"] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if held["updates"] == hang_at:
            time.sleep(600)
        if isinstance(update_info, dict):
            held["segment"] = update_info.get("segment")
            held["segment_fd"] = update_info.get("segment_fd")
        if dies_at >= 0:

            def receive() -> None:
                time.sleep(0.5)  # after the reply went out
                current().update_weights(update_info, round_id=round_id)

            threading.Thread(target=receive, daemon=True).start()
            return
        current().update_weights(update_info, round_id=round_id)

    def shutdown() -> None:
        if held["worker"] is not None:
            held["worker"].shutdown()

    handlers = worker_handlers(current)
    handlers.update(
        setup=setup,
        update_weights=update_weights,
        cuda_memory=torch.cuda.memory_allocated,
        dump=lambda: encode_state(held["module"].named_parameters()),
        abort=lambda: current().abort_weight_update(),
        truncation=lambda: held["truncation"],
        shutdown=shutdown,
    )
    try:
        serve(conn, handlers)
    finally:
        shutdown()
        conn.close()


class PipeWorker:
    """A worker subprocess and its channel; every call waits for its answer with a timeout."""

    def __init__(
        self, *flags: str, rank: int = 0, world_size: int = 1, prefix: tuple[str, ...] = ()
    ) -> None:
        """``prefix``: a command the worker runs under (``unshare ...``: another namespace)."""
        self.rank = rank
        self.world_size = world_size
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [
                    *prefix,
                    sys.executable,
                    HERE,
                    "worker",
                    "--conn-fd",
                    str(theirs.fileno()),
                    *flags,
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        STARTED_PIDS.append(self.proc.pid)
        self.channel = PipeChannel(
            Connection(ours.detach()),
            f"worker[rank={rank}, pid={self.proc.pid}]",
            timeout_s=60.0,
            exitcode=self.proc.poll,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, call: str, *args: Any, timeout_s: float = 60.0) -> Any:
        return self.channel.call(call, *args, timeout_s=timeout_s)

    def setup(
        self, state: Mapping[str, Any], device: str = "cpu", round_timeout_s: float = 0
    ) -> None:
        """Build the worker for ``state``; ``round_timeout_s`` (0: the default) as in the core."""
        self.call("setup", spec_of(state), self.rank, self.world_size, device, round_timeout_s)

    def dump(self) -> dict[str, Any]:
        return decode_state(self.call("dump"))

    def stop(self) -> None:
        """Ask the worker to exit, then kill it by PID if it does not; always reaps."""
        if self.proc.poll() is None:
            self.channel.send_exit()
        stop_processes([self.proc], 10.0)
        self.channel.close()

    def kill(self) -> None:
        """SIGKILL this worker (by its PID) if it still runs; reap it and close the channel."""
        stop_processes([self.proc], 0.0)
        self.channel.close()


class PipeClient(_FanOutClient):
    """The shared fan-out ``WeightSyncClient`` over :class:`PipeWorker` s (their channels, so
    a test's direct ``worker.call`` and the trainer's calls never interleave on one pipe)."""

    def __init__(self, workers: list[PipeWorker], *, timeout_s: float = 60.0) -> None:
        self.workers = workers
        super().__init__(
            [w.channel for w in workers], [w.channel.label for w in workers], timeout_s=timeout_s
        )


def assert_bit_exact(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Same names, dtypes and bits."""
    import torch

    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t.contiguous()), f"{name}: values differ"


def bump(state: Mapping[str, Any]) -> None:
    """A new version of every tensor (in place)."""
    import torch

    for t in state.values():
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.numel():
            t.add_(1)


def trainer_for(workers: list[PipeWorker], state: Any, **kw: Any) -> tuple[Any, Any]:
    """An ipc trainer in this process over ``workers`` (a recording pipe client)."""
    from wtcore import TensorSource, WeightTransferTrainerFactory
    from wtcore.testing import RecordingClient
    from wtcore_ipc import IPCTrainerInitInfo

    client = RecordingClient(PipeClient(workers, timeout_s=60))
    info = IPCTrainerInitInfo(rank=0, **{"timeout_s": 30, **kw})
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=TensorSource(state)
    )
    return trainer, client


def after_a_good_round(workers: list[PipeWorker], state: Any) -> tuple[Any, dict[str, Any]]:
    """Workers built for ``state`` that took one good round (version ``good``, 4 KiB buckets)
    from a trainer in this process; the trainer (shut it down) and that round's announcement."""
    for w in workers:
        w.setup(state)
    trainer, client = trainer_for(workers, state, packed_buffer_size_bytes=4096)
    try:
        trainer.send_weights(weight_version="good")
    except BaseException:
        trainer.shutdown()
        raise
    announce: dict[str, Any] = [p for c, p in client.calls if c == "update_weights"][-1]
    return trainer, announce


def refused_then_synced(
    workers: list[Any],
    trainer: Any,
    state: Any,
    payload: Any,
    message: str,
    heal: Callable[[], None] | None = None,
) -> None:
    """``workers[0]`` refuses ``payload`` (an error matching ``message``) and applies nothing,
    publishes nothing; then (after ``heal``) every worker takes the trainer's next round
    bit-exact."""
    import pytest

    worker = workers[0]
    before = worker.dump()
    worker.call("start_weight_update")
    with pytest.raises(ValueError, match=message):  # PayloadError is a ValueError
        worker.call("update_weights", payload, timeout_s=20)
    assert_bit_exact(worker.dump(), before)
    worker.call("abort")
    if heal is not None:
        heal()
    info = worker.call("weight_info")
    assert info["weight_version"] == "good" and info["state"] == "idle"
    bump(state)
    trainer.send_weights(weight_version="next")
    for w in workers:
        assert_bit_exact(w.dump(), state)
    assert worker.call("weight_info")["consistent"] is True


# ---------------------------------------------------------------------- trainer process
class _StdioClient:
    """The trainer's client in a trainer subprocess: the test process relays each call."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def _call(self, call: str, *args: Any) -> None:
        self.out.write(json.dumps({"call": call, "args": list(args)}) + "\n")
        self.out.flush()
        msg = json.loads(sys.stdin.readline())
        if not msg["ok"]:
            raise ErrorRecord.from_json(msg).to_exception(call)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


class TrainerProc:
    """An ipc trainer in its own process; the test relays its client calls to workers."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, HERE, "trainer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        STARTED_PIDS.append(self.proc.pid)

    def next_message(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the trainer's own timeouts bound this
        assert line, f"trainer exited early (rc={self.proc.poll()})"
        msg: dict[str, Any] = json.loads(line)
        return msg

    def answer(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        stop_processes([self.proc], 0.0)  # SIGKILL if it still runs, and reap it
        for s in (self.proc.stdin, self.proc.stdout):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


def relay_until_update(trainer: TrainerProc, worker: PipeWorker) -> dict[str, Any]:
    """Relay the trainer's calls to ``worker`` until its round's ``update_weights``; return
    that call's announcement, undelivered."""
    while True:
        msg = trainer.next_message()
        if msg["call"] == "update_weights":
            announce: dict[str, Any] = msg["args"][0]
            return announce
        relay(trainer, worker, msg)


def relay(trainer: TrainerProc, worker: PipeWorker, msg: dict[str, Any]) -> None:
    try:
        result = worker.call(msg["call"], *msg["args"])
        trainer.answer({"ok": True, "result": result})
    except Exception as e:
        trainer.answer({"ok": False, **ErrorRecord.from_exception(e).to_json()})


_KEEP: list[Any] = []


def trainer_main(argv: list[str]) -> None:
    import torch

    from wtcore import TensorSource, WeightTransferTrainerFactory
    from wtcore_ipc import IPCTrainerInitInfo

    torch.set_num_threads(1)
    seed, buffer, rounds = int(argv[0]), int(argv[1]), int(argv[2])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    info = IPCTrainerInitInfo(packed_buffer_size_bytes=buffer, timeout_s=30, rank=0)
    state = make_state(seed)
    die_after = (
        int(argv[argv.index("--die-after-tensors") + 1]) if "--die-after-tensors" in argv else 0
    )

    class DyingSource(TensorSource):
        """SIGKILLs this trainer mid-round, after ``die_after`` tensors were packed."""

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(super().__iter__()):
                if i == die_after:
                    time.sleep(0.5)  # let the worker consume what was published
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item

    if "--shared" in argv:
        from wtcore_ipc import share_weights

        _KEEP.append(share_weights(state))  # the tensors move into shared memory, for good
    engine = WeightTransferTrainerFactory.trainer_init(
        info,
        client=_StdioClient(out),
        source=DyingSource(state) if die_after else TensorSource(state),
    )
    for r in range(rounds):
        engine.send_weights(weight_version=f"r{r}")
        out.write(json.dumps({"event": "segment", "name": engine.segment_name}) + "\n")  # type: ignore[attr-defined]
    sys.stdin.readline()  # the test says when to go on (it inspects the segment meanwhile)
    if "--no-shutdown" in argv:
        _KEEP.append(engine)  # alive until exit: the exit-time finalizer must unlink
        return
    engine.shutdown()


if __name__ == "__main__":  # run as a script: its own folder is on sys.path already
    if sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        trainer_main(sys.argv[2:])
