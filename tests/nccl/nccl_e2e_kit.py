"""Worker processes for the nccl end-to-end tests, and the pipe-based client that drives them.

Each worker process owns a real ``WeightSyncWorker`` over a ``ModuleSink`` and serves the
protocol calls that arrive on a ``multiprocessing`` pipe, one at a time. The trainer side
talks to the fleet through :class:`PipeClient`, a ``WeightSyncClient`` that fans every call
out to all workers (``wtcore.fanout``) and maps a dead process or a missing answer to an
error within its timeout. Tensors come back as raw bytes, so comparisons are bit-exact.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from wtcore.errors import TransferError, TransferTimeoutError
from wtcore.fanout import fan_out
from wtcore.meta import dtype_from_name, dtype_name
from wtcore.source import WeightSource

__all__ = [
    "Fleet",
    "Handlers",
    "KillingSource",
    "PipeClient",
    "RemoteError",
    "fleet",
    "make_state",
    "serve",
    "serve_worker",
    "spec_of",
    "wait_until",
]

Spec = list[tuple[str, str, list[int]]]


# ---------------------------------------------------------------------- worker process side
def _encode(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        n: (
            dtype_name(t.dtype),
            list(t.shape),
            t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
        for n, t in state.items()
    }


def _decode(data: Mapping[str, tuple[str, list[int], bytes]]) -> dict[str, torch.Tensor]:
    out = {}
    for n, (dname, shape, raw) in data.items():
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        out[n] = flat.view(dtype_from_name(dname)).reshape(shape)
    return out


Handlers = dict[str, Callable[..., Any]]


def serve(conn: Any, handlers: Handlers) -> None:
    """Answer ``(id, method, args)`` requests from ``conn`` one at a time, until ``exit``."""
    while True:
        try:
            req_id, method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            conn.send((req_id, True, None))
            return
        try:
            conn.send((req_id, True, handlers[method](*args)))
        except BaseException as e:
            conn.send((req_id, False, (type(e).__name__, str(e))))


def serve_worker(
    conn: Any,
    rank: int,
    world_size: int,
    spec: Spec,
    options: dict[str, Any],
    extra: Callable[[Any, torch.nn.Module], Handlers] | None = None,
) -> None:
    """Main of a worker process: a ``WeightSyncWorker`` over a zero model of ``spec``.

    ``extra(worker, module)`` may add handlers (the benchmark adds its baselines).
    """
    torch.set_num_threads(1)
    from wtcore import ModuleSink, WeightSyncWorker
    from wtcore.testing import build_module

    zeros = {n: torch.zeros(shape, dtype=dtype_from_name(d)) for n, d, shape in spec}
    module = build_module(zeros)
    del zeros
    worker = WeightSyncWorker(
        {"backend": "nccl", **options}, ModuleSink(module), rank=rank, world_size=world_size
    )
    handlers: Handlers = {
        m: getattr(worker, m)
        for m in (
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "weight_info",
        )
    }
    handlers["state"] = lambda: _encode(dict(module.named_parameters()))
    if extra is not None:
        handlers.update(extra(worker, module))
    try:
        serve(conn, handlers)
    finally:
        worker.shutdown()


# ---------------------------------------------------------------------- trainer side
class RemoteError(RuntimeError):
    """A worker process raised; ``status`` follows the HTTP mapping (400/409/500)."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.status = {"PayloadError": 400, "ProtocolStateError": 409}.get(error_type, 500)


class PipeClient:
    """A ``WeightSyncClient`` over worker processes, one pipe each."""

    def __init__(self, conns: list[Any], procs: list[Any], *, timeout_s: float) -> None:
        self.conns = conns
        self.procs = procs
        self.timeout_s = timeout_s
        self._locks = [threading.Lock() for _ in conns]
        self._ids = itertools.count(1)

    def call(self, i: int, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One call on worker ``i``; late answers to abandoned calls are skipped by id."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        if not self._locks[i].acquire(timeout=timeout):
            raise TransferTimeoutError(
                f"worker {i}: still busy with an earlier call after {timeout:g} s"
            )
        try:
            req_id = next(self._ids)
            conn = self.conns[i]
            try:
                conn.send((req_id, method, args))
            except (BrokenPipeError, OSError) as e:
                raise TransferError(f"worker {i}: process is gone ({e})") from e
            while True:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TransferTimeoutError(
                        f"worker {i}: no answer to {method} within {timeout:g} s"
                    )
                try:
                    got_id, ok, payload = conn.recv()
                except (EOFError, OSError) as e:
                    self.procs[i].join(2)
                    raise TransferError(
                        f"worker {i}: process died during {method} (exit code {self.procs[i].exitcode})"
                    ) from e
                if got_id != req_id:
                    continue
                if ok:
                    return payload
                raise RemoteError(*payload)
        finally:
            self._locks[i].release()

    def _each(self, method: str, *args: Any) -> list[Any]:
        targets = [
            (f"worker[rank={i}]", lambda i=i: self.call(i, method, *args))
            for i in range(len(self.conns))
        ]
        return fan_out(method, targets, timeout_s=self.timeout_s + 1)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", weight_version)

    def weight_info(self, i: int) -> dict[str, Any]:
        return self.call(i, "weight_info")  # type: ignore[no-any-return]

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return _decode(self.call(i, "state"))


@dataclass
class Fleet:
    client: PipeClient
    procs: list[Any]

    def states(self) -> list[dict[str, torch.Tensor]]:
        return [self.client.state(i) for i in range(len(self.procs))]


@contextmanager
def fleet(
    num_workers: int,
    spec: Spec,
    *,
    timeout_s: float = 20.0,
    options: dict[str, Any] | None = None,
    extra: Callable[[Any, torch.nn.Module], Handlers] | None = None,
) -> Iterator[Fleet]:
    """Start ``num_workers`` worker processes; on exit stop them, killing by PID if needed."""
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    try:
        for rank in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve_worker,
                args=(
                    child,
                    rank,
                    num_workers,
                    spec,
                    dict(options or {"torch_num_threads": 1}),
                    extra,
                ),
                daemon=True,
                name=f"nccl-worker-{rank}",
            )
            proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
        yield Fleet(PipeClient(conns, procs, timeout_s=timeout_s), procs)
    finally:
        for conn, proc in zip(conns, procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send((0, "exit", ()))
                except OSError:
                    pass
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()
        left = [p.pid for p in procs if p.is_alive()]
        assert not left, f"worker processes left behind: {left}"


# ---------------------------------------------------------------------- data
def make_state(seed: int, *, big_numel: int = 12_000, tiny: int = 150) -> dict[str, torch.Tensor]:
    """Mixed dtypes (bf16 included), 0-d and empty tensors, one big tensor, many tiny ones."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "emb.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "big.weight": torch.randn(big_numel, generator=g),  # 48 KB: larger than small buffers
        "fp16.weight": torch.randn(33, generator=g).to(torch.float16),
        "fp64.weight": torch.randn(5, 3, generator=g).double(),
        "idx.buffer": torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
        "mask.buffer": torch.rand(9, generator=g) > 0.5,
        "scalar.weight": torch.randn((), generator=g),
        "empty.weight": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    for i in range(tiny):
        state[f"tiny.{i}.weight"] = torch.randn(3, generator=g).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
    return state


def spec_of(state: Mapping[str, torch.Tensor]) -> Spec:
    return [(n, dtype_name(t.dtype), list(t.shape)) for n, t in state.items()]


def wait_until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class KillingSource(WeightSource):
    """Yields ``inner``'s tensors and kills ``proc`` (SIGKILL) just before item ``at``."""

    def __init__(self, inner: WeightSource, proc: Any, at: int) -> None:
        self.inner, self.proc, self.at = inner, proc, at

    def metadata(self) -> list[Any]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.at:
                self.proc.kill()
                self.proc.join(5)
            yield item
