"""``wtcore bench --backend tcp``: nccl's gloo baselines (one yardstick for both) and the
``zmq`` peer, written as a user would with its fastest calls: a PUSH socket per receiver, each
tensor one zero-copy message ``recv_into`` the receiver's tensor, digests checked after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError
from wtcore_bench.api import Baseline, BaselineContext, EngineBench, OptionalDependencyError
from wtcore_bench.limits import session_gbps
from wtcore_bench.received import Spec, answer, next_message, spawned
from wtcore_bench.support.nccl import GLOO_BASELINES

if TYPE_CHECKING:
    from wtcore.trainer import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["BENCH", "TCPBench", "zmq_session"]


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:
        raise OptionalDependencyError(
            "the zmq peer needs pyzmq 26 or later: pip install 'pyzmq>=26'"
        ) from e
    return zmq


def _zmq_receiver(rank: int, endpoint: str, timeout_s: float, spec: Spec, conn: Any) -> None:
    import torch

    from wtcore.digest import digest_named
    from wtcore_bench.received import zeros_from_spec

    zmq = _zmq()
    torch.set_num_threads(1)
    model = zeros_from_spec(spec)
    flat = [t.reshape(-1).view(torch.uint8) for t in model.values()]
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    conn.send(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        while next_message(conn) is not None:
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
    """The ``zmq`` peer, one round per call."""
    import torch

    from wtcore.digest import digest_named
    from wtcore_bench.received import check_digests, state_spec

    zmq = _zmq()
    args = (f"tcp://{ctx.host}:*", ctx.timeout_s, state_spec(ctx.state))
    socks: list[Any] = []
    with spawned(_zmq_receiver, ctx.receivers, *args) as pipes:

        def wait(parent: Any, what: str) -> Any:
            return answer(parent, ctx.timeout_s, "zmq peer", what)

        try:
            for parent in pipes:
                sock = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.SNDTIMEO, int(ctx.timeout_s * 1000))
                sock.connect(wait(parent, "endpoint"))
                socks.append(sock)
            tensors = [
                t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in ctx.state.values()
            ]

            def run() -> None:
                for parent in pipes:
                    parent.send(True)
                trackers = [s.send(t, copy=False, track=True) for t in tensors for s in socks]
                for parent in pipes:
                    wait(parent, "end of round")
                for tracker in trackers:
                    tracker.wait(ctx.timeout_s)  # zmq let go of the tensor's memory

            yield run
            for parent in pipes:
                parent.send(None)
            want = digest_named(ctx.state.items())
            for rank, parent in enumerate(pipes, start=1):
                check_digests("zmq peer", f"rank {rank}", want, wait(parent, "digests"))
        finally:
            for sock in socks:
                sock.close(linger=0)


@dataclass(frozen=True)
class TCPBench(EngineBench):
    """The sender listens on ``host`` (the kernel picks the port)."""

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
        **GLOO_BASELINES,
        "zmq": Baseline(
            "pyzmq, zero-copy send, recv_into the model",
            partial(session_gbps, zmq_session),
            peer=True,
            session=zmq_session,
        ),
    },
)
