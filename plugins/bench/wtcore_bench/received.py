"""What a baseline's receivers hold, checked against what was sent, and the receiver processes.

A peer is a yardstick only if it moved the weights exactly, so its receivers report digests the
sender checks. Raw bytes travel with the spec beside them, never as a pickled tensor.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from wtcore.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Spec",
    "answer",
    "check_digests",
    "next_message",
    "raw_state",
    "spawned",
    "state_from_raw",
    "state_spec",
    "zeros_from_spec",
]

#: ``[(name, dtype name, shape)]``: enough to rebuild zeros or decode raw bytes.
Spec = list[tuple[str, str, list[int]]]


def state_spec(state: Mapping[str, torch.Tensor]) -> Spec:
    from wtcore.meta import dtype_name

    return [(n, dtype_name(t.dtype), list(t.shape)) for n, t in state.items()]


def zeros_from_spec(spec: Spec, device: str = "cpu") -> dict[str, torch.Tensor]:
    import torch

    from wtcore.meta import dtype_from_name

    return {n: torch.zeros(s, dtype=dtype_from_name(d), device=device) for n, d, s in spec}


def check_digests(
    label: str, receiver: str, want: Mapping[str, str], got: Mapping[str, str]
) -> None:
    bad = sorted(n for n, d in want.items() if got.get(n) != d)
    if bad:
        raise TransferError(
            f"{label}: receiver {receiver} holds different bytes for {len(bad)} tensor(s), "
            f"first {bad[0]!r}"
        )


def raw_state(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    from wtcore.buckets import as_bytes

    return {n: bytes(as_bytes(t.detach().cpu().contiguous()).numpy()) for n, t in items}


def state_from_raw(raw: Mapping[str, bytes], spec: Spec) -> dict[str, torch.Tensor]:
    import torch

    from wtcore.meta import dtype_from_name

    out = {}
    for name, dtype, shape in spec:
        data = raw[name]
        flat = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = flat.view(dtype_from_name(dtype)).reshape(shape)
    return out


@contextlib.contextmanager
def spawned(target: Callable[..., None], count: int, *args: Any) -> Iterator[list[Any]]:
    """Processes ``1 .. count`` running ``target(rank, *args, pipe)``; yields this side's
    pipe ends, and reaps the processes on exit."""
    from wtcore.testing.procs import stop_processes

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(count)]
    procs = []
    try:
        for rank, (_, child) in enumerate(pipes, start=1):
            p = ctx.Process(target=target, args=(rank, *args, child), daemon=True)
            p.start()
            procs.append(p)
        yield [parent for parent, _ in pipes]
    finally:
        for parent, _ in pipes:
            parent.close()
        stop_processes(procs, 30.0)


def answer(conn: Any, timeout_s: float, label: str, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise TransferTimeoutError(f"{label}: a receiver sent no {what} within {timeout_s}s")
    return conn.recv()


def next_message(conn: Any) -> Any:
    """The sender's next message; ``None`` (stop) also when its end of the pipe closed."""
    try:
        return conn.recv()
    except EOFError:
        return None
