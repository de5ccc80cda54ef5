"""``wtcore bench --backend tcp``: the engine's bench API and the baselines that matter for it.

* ``raw_gloo`` and ``per_tensor``: the same limit and naive loop as nccl's
  (:mod:`wtcore_bench.support.nccl`), so tcp and nccl are measured against one yardstick;
* ``zmq`` (a peer, ``--baselines peers``): the round over a maintained transport library,
  pyzmq, as a user would write it with its fastest calls: one PUSH socket per receiver, every
  tensor one message sent zero-copy (``copy=False``), received with ``recv_into`` straight
  into the receiver's tensor (no copy), a round's end acknowledged on a pipe. It answers
  "would a library carry our stream as fast?" in the same run. Every receiver's digests are
  checked after the session (a mismatch is a :class:`~wtcore.errors.TransferError`).

Nothing here is imported until the bench asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench, OptionalDependencyError
from wtcore_bench.received import Spec
from wtcore_bench.support.nccl import (
    _next_message,
    _spawn,
    per_tensor_gbps,
    per_tensor_session,
    raw_gloo_gbps,
    raw_gloo_session,
)

if TYPE_CHECKING:
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["BENCH", "TCPBench", "zmq_gbps", "zmq_session"]


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:
        raise OptionalDependencyError(
            "the zmq peer needs pyzmq 26 or later: pip install 'pyzmq>=26'"
        ) from e
    return zmq


def _zmq_receiver(rank: int, endpoint: str, timeout_s: float, metas: Spec, conn: Any) -> None:
    """Receive a round into the model per ``True`` from the sender, until ``None``; then
    send the model's digests."""
    import torch

    from wtcore.digest import digest_named
    from wtcore_bench.received import zeros_from_spec

    zmq = _zmq()
    torch.set_num_threads(1)
    model = zeros_from_spec(metas)
    flat = [t.reshape(-1).view(torch.uint8) for t in model.values()]
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    conn.send(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        while _next_message(conn) is not None:
            for buf in flat:
                n = sock.recv_into(buf.numpy())
                if n != buf.numel():
                    raise TransferError(
                        f"zmq peer: {n} bytes arrived for a {buf.numel()}-byte tensor"
                    )
            conn.send("round")
        conn.send(digest_named(model.items()))
    finally:
        sock.close(linger=0)


@contextlib.contextmanager
def zmq_session(ctx: BaselineContext) -> Iterator[Callable[[], object]]:
    """The ``zmq`` peer, one round per call of what it yields (see the module docstring)."""
    import multiprocessing as mp

    import torch

    from wtcore.digest import digest_named
    from wtcore.errors import TransferTimeoutError
    from wtcore.testing.procs import stop_processes
    from wtcore_bench.received import check_digests, state_spec

    zmq = _zmq()
    metas = state_spec(ctx.state)
    pipes = [mp.get_context("spawn").Pipe() for _ in range(ctx.receivers)]
    procs = _spawn(
        _zmq_receiver,
        ctx.receivers,
        (f"tcp://{ctx.host}:*", ctx.timeout_s, metas),
        per_rank=[(child,) for _, child in pipes],
    )
    socks: list[Any] = []

    def answer(parent: Any, what: str) -> Any:
        if not parent.poll(ctx.timeout_s):
            raise TransferTimeoutError(f"zmq peer: a receiver sent no {what} in {ctx.timeout_s}s")
        return parent.recv()

    try:
        for parent, _ in pipes:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(ctx.timeout_s * 1000))
            sock.connect(answer(parent, "endpoint"))
            socks.append(sock)
        tensors = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in ctx.state.values()]

        def run() -> None:
            for parent, _ in pipes:
                parent.send(True)
            trackers = [s.send(t, copy=False, track=True) for t in tensors for s in socks]
            for parent, _ in pipes:
                answer(parent, "end of round")
            for tracker in trackers:
                tracker.wait(ctx.timeout_s)  # zmq let go of the tensor's memory

        yield run
        for parent, _ in pipes:
            parent.send(None)
        want = digest_named(ctx.state.items())
        for rank, (parent, _) in enumerate(pipes, start=1):
            check_digests("zmq peer", f"rank {rank}", want, answer(parent, "digests"))
    finally:
        for sock in socks:
            sock.close(linger=0)
        for parent, _ in pipes:
            parent.close()
        stop_processes(procs, 30.0)


def zmq_gbps(ctx: BaselineContext, repeats: int = 3) -> float:
    """The ``zmq`` peer: see :func:`zmq_session`."""
    from wtcore_bench.limits import session_gbps

    return session_gbps(zmq_session, ctx, repeats)


@dataclass(frozen=True)
class TCPBench(EngineBench):
    """The sender listens on ``host`` (a port the kernel picks); every receiver connects."""

    def init_info(
        self,
        engine: type[TrainerWeightTransferEngine],
        *,
        receivers: int,
        host: str,
        buffer_size_bytes: int | None,
        device: str = "cpu",
    ) -> TrainerInitInfo:
        from wtcore_channel import DEFAULT_BUFFER_SIZE
        from wtcore_tcp import TCPTrainerInitInfo

        return TCPTrainerInitInfo(
            rank=0,
            address=host,
            world_size=receivers + 1,
            packed_buffer_size_bytes=buffer_size_bytes or DEFAULT_BUFFER_SIZE,
        )


#: ``engine.tcp`` in ``wtcore.bench``.
BENCH = TCPBench(
    buffer_option="packed_buffer_size_bytes",
    baselines={
        "raw_gloo": Baseline("raw gloo broadcast", raw_gloo_gbps, session=raw_gloo_session),
        "per_tensor": Baseline(
            "per-tensor broadcast + control call", per_tensor_gbps, session=per_tensor_session
        ),
        "zmq": Baseline(
            "pyzmq, zero-copy send, recv_into the model", zmq_gbps, peer=True, session=zmq_session
        ),
    },
)
