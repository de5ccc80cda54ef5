"""A control plane over ``multiprocessing`` pipes, for tests and benchmarks with real processes.

A child runs :func:`serve_worker`, the parent's :class:`PipeClient` fans out to the children,
and :func:`pipe_fleet` starts and always stops them. As on every production control plane,
messages are JSON (never pickles), waits are bounded, and a child's error comes back as a
:class:`~wtcore.errors.RemoteError`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from wtcore.client import WeightSyncClient, calls_of
from wtcore.errors import (
    ErrorRecord,
    PayloadError,
    RemoteError,
    TransferError,
    TransferTimeoutError,
)
from wtcore.testing.procs import stop_processes
from wtcore_kit.fanout import FanOutClient, receiver_args

if TYPE_CHECKING:
    import torch

    from wtcore.worker import WeightSyncWorker

__all__ = [
    "WORKER_CALLS",
    "Handlers",
    "PipeChannel",
    "PipeClient",
    "PipeFleet",
    "RemoteError",  # wtcore.errors.RemoteError: what a child's error is raised as
    "decode_state",
    "encode_state",
    "pipe_fleet",
    "serve",
    "serve_worker",
    "worker_handlers",
]

#: Handlers of one child: call name -> function of the JSON arguments, returning JSON.
Handlers = dict[str, Callable[..., Any]]

#: The calls :func:`worker_handlers` answers: the protocol, plus the inspection calls.
WORKER_CALLS = (*calls_of(WeightSyncClient), "abort_weight_update", "weight_info", "checksums")

# Request ids are unique across every client of this process, so an answer that arrives
# after its call was abandoned (timeout) can never be taken for the answer to a later call.
_IDS = itertools.count(1)


def _encode(msg: Mapping[str, Any]) -> bytes:
    return json.dumps(msg).encode()


def _send(conn: Connection, msg: Mapping[str, Any]) -> None:
    conn.send_bytes(_encode(msg))


def _recv(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes())


def serve(conn: Connection, handlers: Mapping[str, Callable[..., Any]]) -> None:
    """Answer ``{"id", "call", "args", "kwargs"}`` requests on ``conn`` one at a time, until
    ``exit`` or EOF (a parent that dies takes its children with it); ``ping`` always answers."""
    while True:
        try:
            req = _recv(conn)
        except (EOFError, OSError):
            return
        req_id, call, args = req.get("id"), req.get("call"), req.get("args", [])
        kwargs = req.get("kwargs") or {}
        if call == "exit":
            with contextlib.suppress(OSError):
                _send(conn, {"id": req_id, "ok": True, "result": None})
            return
        try:
            if call == "ping":
                result: Any = True
            elif call in handlers:
                result = handlers[call](*args, **kwargs)
            else:
                raise PayloadError(f"unknown call {call!r}; this child answers {sorted(handlers)}")
            data = _encode({"id": req_id, "ok": True, "result": result})
        except Exception as e:  # a result that is not JSON is the child's error too
            data = _encode({"id": req_id, "ok": False, **ErrorRecord.from_exception(e).to_json()})
        try:
            conn.send_bytes(data)
        except OSError:
            return


def worker_handlers(get_worker: Callable[[], WeightSyncWorker]) -> Handlers:
    """Handlers for :data:`WORKER_CALLS`, on whatever worker ``get_worker()`` returns now."""
    return {
        name: (lambda *a, _n=name, **kw: getattr(get_worker(), _n)(*a, **kw))
        for name in WORKER_CALLS
    }


def serve_worker(
    conn: Connection,
    make_worker: Callable[[], WeightSyncWorker],
    extra_handlers: Callable[[WeightSyncWorker], Handlers] | None = None,
) -> None:
    """Main of a child process: build one worker, serve it on ``conn``, shut it down.

    ``make_worker`` runs in the child; ``extra_handlers(worker)`` adds calls. For a ``spawn``
    child both must be picklable (module-level functions or ``functools.partial``).
    """
    worker = make_worker()
    try:
        handlers = worker_handlers(lambda: worker)
        if extra_handlers is not None:
            handlers.update(extra_handlers(worker))
        serve(conn, handlers)
    finally:
        worker.shutdown()
        conn.close()


class PipeChannel:
    """The parent's end of one child: one call at a time, every wait bounded."""

    def __init__(
        self,
        conn: Connection,
        label: str,
        *,
        timeout_s: float,
        exitcode: Callable[[], int | None] | None = None,
    ) -> None:
        self.conn = conn
        self.label = label
        self.timeout_s = timeout_s
        self._exitcode = exitcode
        self._lock = threading.Lock()

    def _gone(self, call: str, what: str, cause: BaseException) -> TransferError:
        code = f", exit code {self._exitcode()}" if self._exitcode is not None else ""
        return TransferError(f"{self.label}.{call}: child process {what} ({cause!r}{code})")

    def call(self, call: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Send one request and wait (bounded) for its answer; late answers are skipped by id."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        where = f"{self.label}.{call}"
        if not self._lock.acquire(timeout=timeout):
            raise TransferTimeoutError(
                f"{where}: still busy with an earlier call after {timeout:g} s"
            )
        try:
            req_id = next(_IDS)
            try:
                request = {"id": req_id, "call": call, "args": list(args)}
                if kwargs:
                    request["kwargs"] = kwargs
                _send(self.conn, request)
            except (OSError, ValueError) as e:  # ValueError: our end is already closed
                raise self._gone(call, "is gone", e) from e
            while True:
                try:
                    ready = self.conn.poll(max(0.0, deadline - time.monotonic()))
                    msg = _recv(self.conn) if ready else None
                except (EOFError, OSError) as e:
                    raise self._gone(call, "died", e) from e
                if msg is None:
                    raise TransferTimeoutError(f"{where}: no answer within {timeout:g} s")
                if msg.get("id") != req_id:
                    continue
                if msg["ok"]:
                    return msg["result"]
                try:
                    record = ErrorRecord.from_json(msg)
                except PayloadError as e:
                    raise TransferError(
                        f"{where}: the child answered a malformed error: {e}"
                    ) from e
                raise record.to_exception(where)
        finally:
            self._lock.release()

    def send_exit(self) -> None:
        """Ask the child to stop, without waiting (it may be gone already)."""
        with contextlib.suppress(OSError, ValueError):
            _send(self.conn, {"id": 0, "call": "exit"})

    def close(self) -> None:
        self.conn.close()


class PipeClient(FanOutClient):
    """A ``WeightSyncClient`` over child processes, one pipe (or shared :class:`PipeChannel`)
    each; protocol calls fan out, :meth:`call` reaches one child."""

    def __init__(
        self,
        conns: Sequence[Connection | PipeChannel],
        labels: Sequence[str] | None = None,
        *,
        timeout_s: float,
    ) -> None:
        labels = [f"worker[rank={i}]" for i in range(len(conns))] if labels is None else labels
        if len(labels) != len(conns):
            raise PayloadError(f"{len(conns)} connections but {len(labels)} labels")
        self.timeout_s = timeout_s
        self.channels = [
            c if isinstance(c, PipeChannel) else PipeChannel(c, lbl, timeout_s=timeout_s)
            for c, lbl in zip(conns, labels, strict=True)
        ]

    def call(
        self, i: int, call: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        return self.channels[i].call(
            call, *args, timeout_s=self.timeout_s if timeout_s is None else timeout_s, **kwargs
        )

    def _targets(self, call: str, *args: Any, **kwargs: Any) -> list[tuple[str, Callable[[], Any]]]:
        return [
            (ch.label, functools.partial(self.call, i, call, *receiver_args(args, i), **kwargs))
            for i, ch in enumerate(self.channels)
        ]

    def _deadline_s(self) -> float:
        return self.timeout_s + 5  # each call bounds itself; this is only a backstop

    def get_world_size(self) -> int:
        return len(self.channels)


@dataclass
class PipeFleet:
    client: PipeClient
    procs: list[mp.process.BaseProcess]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]


@contextlib.contextmanager
def pipe_fleet(
    make_workers: Sequence[Callable[[], WeightSyncWorker]],
    *,
    timeout_s: float,
    extra_handlers: Callable[[WeightSyncWorker], Handlers] | None = None,
    labels: Sequence[str] | None = None,
    ready_timeout_s: float | None = None,
    join_timeout_s: float = 10.0,
) -> Iterator[PipeFleet]:
    """One ``spawn`` child per ``make_workers`` entry, each running :func:`serve_worker`;
    ``ready_timeout_s`` waits for slow starts. On exit every child is stopped, by PID if need be.
    """
    ctx = mp.get_context("spawn")
    names = [f"worker[rank={i}]" for i in range(len(make_workers))] if labels is None else labels
    channels: list[PipeChannel] = []
    procs: list[mp.process.BaseProcess] = []
    try:
        for make, label in zip(make_workers, names, strict=True):
            parent, child = ctx.Pipe()
            proc: mp.process.BaseProcess = ctx.Process(
                target=serve_worker, args=(child, make, extra_handlers), daemon=True, name=label
            )
            proc.start()
            child.close()
            procs.append(proc)
            channels.append(
                PipeChannel(
                    parent,
                    label,
                    timeout_s=timeout_s,
                    exitcode=functools.partial(getattr, proc, "exitcode"),
                )
            )
        client = PipeClient(channels, timeout_s=timeout_s)
        if ready_timeout_s is not None:
            for i in range(len(channels)):
                client.call(i, "ping", timeout_s=ready_timeout_s)
        yield PipeFleet(client, procs)
    finally:
        for ch, started in zip(channels, procs, strict=True):
            if started.is_alive():
                ch.send_exit()
        stop_processes(procs, join_timeout_s)  # by PID: only processes started here
        for ch in channels:
            ch.close()
        left = [p.pid for p in procs if p.is_alive()]
        assert not left, f"child processes left behind: {left}"


def encode_state(
    items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, Any]:
    """The wire metadata plus ``data``, base64 of one bucket packed by the core's rule: exact
    for every dtype, and plain JSON."""
    import torch

    from wtcore.buckets import pack_bucket, plan_buckets
    from wtcore.meta import ParamMeta, metas_to_wire

    pairs = items.items() if isinstance(items, Mapping) else items
    tensors = {name: t.detach().cpu().contiguous() for name, t in pairs}
    metas = [ParamMeta.of(name, t) for name, t in tensors.items()]
    raw = b""
    for bucket in plan_buckets(metas, _ONE_BUCKET):  # at most one
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        raw = pack_bucket(bucket, list(tensors.values()), buf).numpy().tobytes()
    return {**metas_to_wire(metas), "data": base64.b64encode(raw).decode()}


def decode_state(data: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`encode_state`, checked as a receiver checks an update."""
    import torch

    from wtcore.buckets import plan_buckets, unpack_bucket
    from wtcore.meta import metas_from_wire

    metas = metas_from_wire(data.get("names"), data.get("dtype_names"), data.get("shapes"))
    raw = bytearray(base64.b64decode(str(data.get("data", "")), validate=True))
    buckets = plan_buckets(metas, _ONE_BUCKET)
    planned = sum(b.nbytes for b in buckets)
    if len(raw) != planned:
        raise PayloadError(f"data: {len(raw)} bytes, but the metadata plans {planned}")
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        buf = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out.update((name, t.clone()) for name, t in unpack_bucket(bucket, buf))
    return out


#: Larger than any state a test sends: every state is one bucket.
_ONE_BUCKET = 1 << 62
