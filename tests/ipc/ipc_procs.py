"""Real worker and trainer processes for the ipc tests, with a JSON-lines control plane.

Run as a script: ``python ipc_procs.py worker [--die-at-update N] [--hang-at-update N]`` serves
a :class:`wtcore.WeightSyncWorker` (backend ``ipc``) over stdin/stdout; ``python ipc_procs.py
trainer SEED BUFFER ROUNDS [--no-shutdown]`` runs an ipc trainer whose client writes each call
to stdout and reads the answer from stdin, so the test process relays (and can interfere).
Imported by the tests (by path) for :class:`PipeWorker`, :class:`PipeClient` and
:func:`make_state`. Every message is one JSON object per line: no pickle, as in production.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

HERE = os.path.abspath(__file__)
#: PIDs of every process started here (for the /dev/shm leak check).
STARTED_PIDS: list[int] = [os.getpid()]


def our_segments(pids: list[int] | None = None) -> list[str]:
    """Segments in /dev/shm created by any of ``pids`` (names carry the creator's PID).

    Only names with these PIDs are checked, so parallel test runs never see each other.
    """
    from wtcore_ipc.shm import SHM_DIR, segment_prefix

    prefixes = tuple(segment_prefix(p) for p in (STARTED_PIDS if pids is None else pids))
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefixes))


# ---------------------------------------------------------------------- shared state
def make_state(seed: int, *, big: int = 0) -> dict[str, Any]:
    """Mixed dtypes, many small tensors, and (if ``big``) one tensor of ``big`` float32s."""
    import torch

    from wtcore.testing import mixed_dtype_state

    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = dict(mixed_dtype_state(seed))
    for i in range(24):
        state[f"layers.{i}.w"] = torch.randn(33 + 7 * i, 17, generator=g).to(
            (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        )
        state[f"layers.{i}.idx"] = torch.randint(0, 1000, (i + 1,), generator=g, dtype=torch.int32)
    if big:
        state["huge.w"] = torch.randn(big, generator=g)
    return state


def spec_of(state: Mapping[str, Any]) -> dict[str, Any]:
    from wtcore.meta import ParamMeta, metas_to_wire

    return metas_to_wire([ParamMeta.of(n, t) for n, t in state.items()])


def encode_state(items: Any) -> dict[str, Any]:
    from wtcore.buckets import as_bytes
    from wtcore.meta import dtype_name

    out = {}
    for name, t in items:
        raw = as_bytes(t.detach().cpu().contiguous()).numpy().tobytes()
        out[name] = [dtype_name(t.dtype), list(t.shape), base64.b64encode(raw).decode()]
    return out


def decode_state(data: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    from wtcore.meta import dtype_from_name

    out = {}
    for name, (dname, shape, b64) in data.items():
        raw = bytearray(base64.b64decode(b64))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = flat.view(dtype_from_name(dname)).reshape(shape).clone()
    return out


# ---------------------------------------------------------------------- errors over JSON
_ERRORS = ("PayloadError", "ProtocolStateError", "TransferError", "TransferTimeoutError")


def error_to_json(e: BaseException) -> dict[str, Any]:
    return {"ok": False, "type": type(e).__name__, "message": str(e)}


def error_from_json(msg: Mapping[str, Any], where: str) -> Exception:
    import wtcore.errors as errs

    cls = getattr(errs, msg["type"]) if msg["type"] in _ERRORS else RuntimeError
    err: Exception = cls(f"{where}: {msg['type']}: {msg['message']}")
    return err


# ---------------------------------------------------------------------- worker process
def worker_main(argv: list[str]) -> None:
    import torch

    from wtcore import ModuleSink, WeightSyncWorker
    from wtcore.meta import metas_from_wire
    from wtcore.testing import build_module

    torch.set_num_threads(1)
    die_at = int(argv[argv.index("--die-at-update") + 1]) if "--die-at-update" in argv else 0
    hang_at = int(argv[argv.index("--hang-at-update") + 1]) if "--hang-at-update" in argv else 0
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol
    worker: WeightSyncWorker | None = None
    module: torch.nn.Module | None = None
    updates = 0
    for line in sys.stdin:
        req = json.loads(line)
        call, args = req["call"], req.get("args", [])
        try:
            result: Any = None
            if call == "setup":
                spec, rank, world, device = args
                if worker is not None:
                    worker.shutdown()
                metas = metas_from_wire(spec["names"], spec["dtype_names"], spec["shapes"])
                module = build_module({m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas})
                module.to(device)
                worker = WeightSyncWorker(
                    "ipc", ModuleSink(module), device=device, rank=rank, world_size=world
                )
            elif call == "cuda_memory":
                result = torch.cuda.memory_allocated()
            elif call == "dump":
                assert module is not None
                result = encode_state(module.named_parameters())
            elif call == "weight_info":
                assert worker is not None
                result = worker.weight_info()
            elif call == "abort":
                assert worker is not None
                worker.abort_weight_update()
            elif call == "shutdown":
                if worker is not None:
                    worker.shutdown()
            else:
                assert worker is not None
                if call == "update_weights":
                    updates += 1
                    if updates == die_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if updates == hang_at:
                        time.sleep(600)
                result = getattr(worker, call)(*args)
            out.write(json.dumps({"ok": True, "result": result}) + "\n")
        except Exception as e:
            out.write(json.dumps(error_to_json(e)) + "\n")
    if worker is not None:
        worker.shutdown()


class PipeWorker:
    """A worker subprocess; every call waits for its answer with a timeout."""

    def __init__(self, *flags: str, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.proc = subprocess.Popen(
            [sys.executable, HERE, "worker", *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        STARTED_PIDS.append(self.proc.pid)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._answers.put(json.loads(line))
        self._answers.put(None)  # EOF: the process is gone

    def call(self, call: str, *args: Any, timeout_s: float = 60.0) -> Any:
        from wtcore.errors import TransferError, TransferTimeoutError

        where = f"worker[rank={self.rank}, pid={self.pid}].{call}"
        with self._lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"call": call, "args": list(args)}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise TransferError(f"{where}: worker process is gone ({e})") from e
            try:
                msg = self._answers.get(timeout=timeout_s)
            except queue.Empty:
                raise TransferTimeoutError(f"{where}: no answer within {timeout_s:g} s") from None
        if msg is None:
            self._answers.put(None)
            raise TransferError(f"{where}: worker process exited (rc={self.proc.poll()})")
        if not msg["ok"]:
            raise error_from_json(msg, where)
        return msg["result"]

    def setup(self, state: Mapping[str, Any], device: str = "cpu") -> None:
        self.call("setup", spec_of(state), self.rank, self.world_size, device)

    def dump(self) -> dict[str, Any]:
        return decode_state(self.call("dump"))

    def stop(self) -> None:
        """Close stdin, then kill by PID if it does not exit; always reaps."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.kill()

    def kill(self) -> None:
        """SIGKILL this worker (by its PID) if it still runs; reap it and close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class PipeClient:
    """A ``WeightSyncClient`` fanning out to :class:`PipeWorker` processes."""

    def __init__(self, workers: list[PipeWorker], *, timeout_s: float = 60.0) -> None:
        self.workers = workers
        self.timeout_s = timeout_s

    def _each(self, call: str, *args: Any) -> None:
        from wtcore.fanout import fan_out

        targets = [
            (f"rank{w.rank}", lambda w=w: w.call(call, *args, timeout_s=self.timeout_s))
            for w in self.workers
        ]
        fan_out(call, targets, timeout_s=self.timeout_s + 5)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._each("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", weight_version)


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
            raise error_from_json(msg, call)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


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
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=_StdioClient(out), source=TensorSource(state)
    )
    for r in range(rounds):
        engine.send_weights(weight_version=f"r{r}")
        out.write(json.dumps({"event": "segment", "name": engine.segment_name}) + "\n")  # type: ignore[attr-defined]
    sys.stdin.readline()  # the test says when to go on (it inspects /dev/shm meanwhile)
    if "--no-shutdown" in argv:
        _KEEP.append(engine)  # alive until exit: the exit-time finalizer must unlink
        return
    engine.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    if sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        trainer_main(sys.argv[2:])
