"""Worker processes for the nccl end-to-end tests, driven over ``wtcore.testing.pipes``.

Each worker process owns a real ``WeightSyncWorker`` over a ``ModuleSink`` of a zero model
and serves the protocol calls that arrive on its pipe (:func:`wtcore.testing.pipes.serve_worker`);
the trainer side talks to the fleet through the shared :class:`~wtcore.testing.pipes.PipeClient`,
which fans every call out and maps a dead process or a missing answer to an error within its
timeout. This kit only adds what is nccl-specific: how a worker is built, a ``state`` dump
(tensors as raw bytes, so comparisons are bit-exact) and the test data. The helpers every
suite shares (``spec_of``, ``wait_until``, ``KillingSource``, ``make_state``) are
:mod:`wtcore.testing`'s; ``spec_of`` is re-exported here for the modules that import it from
this kit, and ``make_state`` is the shared builder's ``"edges"`` model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from wtcore.testing import sources
from wtcore.testing.net import free_port
from wtcore.testing.pipes import Handlers, PipeClient, decode_state, encode_state, pipe_fleet
from wtcore.testing.sources import spec_of, state_of_spec
from wtcore.worker import WeightSyncWorker
from wtcore_kit.concurrency import BackgroundCall
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_nccl.group import Group, connect_store, host_store, join_group, release_group

__all__ = [
    "Fleet",
    "Handlers",
    "fleet",
    "loopback_info",
    "make_state",
    "spec_of",
]

#: A model's names, dtypes and shapes (:func:`wtcore.testing.spec_of`).
Spec = dict[str, Any]
#: Extra handlers for a worker process, given its worker (``worker.sink.module`` is the model).
Extra = Callable[[WeightSyncWorker], Handlers]


# ---------------------------------------------------------------------- worker process side
def _make_worker(
    rank: int, world_size: int, spec: Spec, options: dict[str, Any], backend: str = "nccl"
) -> WeightSyncWorker:
    """Runs in the worker process: a ``WeightSyncWorker`` of ``backend`` over a zero model of
    ``spec``."""
    torch.set_num_threads(1)
    from wtcore import ModuleSink
    from wtcore.testing import build_module

    module = build_module(state_of_spec(spec))
    return WeightSyncWorker(
        {"backend": backend, **options}, ModuleSink(module), rank=rank, world_size=world_size
    )


def _handlers(extra: Extra | None, worker: WeightSyncWorker) -> Handlers:
    """``state`` (what the model holds, for bit-exact checks) plus the caller's extras."""
    module = worker.sink.module  # type: ignore[attr-defined]
    handlers: Handlers = {"state": lambda: encode_state(module.named_parameters())}
    if extra is not None:
        handlers.update(extra(worker))
    return handlers


# ---------------------------------------------------------------------- trainer side
@dataclass
class Fleet:
    client: PipeClient
    procs: list[Any]
    backend: str = "nccl"

    def states(self) -> list[dict[str, torch.Tensor]]:
        return [decode_state(self.client.call(i, "state")) for i in range(len(self.procs))]

    def assert_synced(self, state: Mapping[str, torch.Tensor], version: str) -> None:
        """Every worker published ``version``, consistent, holding ``state`` bit for bit."""
        for i, got in enumerate(self.states()):
            info = self.client.call(i, "weight_info")
            assert (info["weight_version"], info["consistent"]) == (version, True), (i, info)
            for name, t in state.items():
                assert torch.equal(got[name], t), (i, name)


@contextmanager
def fleet(
    num_workers: int,
    spec: Spec,
    *,
    timeout_s: float = 20.0,
    options: dict[str, Any] | None = None,
    extra: Extra | None = None,
    ready_timeout_s: float = 180.0,
    backend: str = "nccl",
) -> Iterator[Fleet]:
    """Start ``num_workers`` worker processes; on exit stop them, killing by PID if needed,
    and assert that none is left (``pipe_fleet`` does all three).

    The fleet is yielded only once every worker answered (torch imported, worker built), so
    the caller's timers never include a spawn on a loaded machine.

    ``extra(worker)`` may add handlers (the benchmark adds its probes); it must be picklable.
    ``backend``: the workers' engine (``tcp`` workers take no options).
    """
    opts = dict(options if options is not None else {"torch_num_threads": 1})
    makes = [
        functools.partial(_make_worker, rank, num_workers, spec, opts, backend)
        for rank in range(num_workers)
    ]
    with pipe_fleet(
        makes,
        timeout_s=timeout_s,
        extra_handlers=functools.partial(_handlers, extra),
        ready_timeout_s=ready_timeout_s,
    ) as pf:
        yield Fleet(pf.client, pf.procs, backend)


# ---------------------------------------------------------------------- data
#: The streamed engines' test model (mixed dtypes with bf16, 0-d and empty tensors, one big
#: tensor, many tiny ones): :func:`wtcore.testing.make_state`'s ``"edges"``, shared with tcp.
make_state = functools.partial(sources.make_state, kind="edges")


def loopback_info(
    *, world_size: int = 2, master_port: int | None = None, **fields: Any
) -> NCCLTrainerInitInfo:
    """The sender's (rank 0) init info for a group on loopback, at ``master_port`` (a free
    one if ``None``)."""
    return NCCLTrainerInitInfo(
        rank=0,
        master_address="127.0.0.1",
        master_port=free_port() if master_port is None else master_port,
        world_size=world_size,
        **fields,
    )


def join_loopback(
    store: Any, rank: int, port: int, world: int, timeout_s: float, broadcast: str, secret: str = ""
) -> Group:
    """Join rank ``rank`` of a gloo-transport group on loopback (the store at ``port``)."""
    return join_group(
        store, generation=1, rank=rank, world_size=world, transport="gloo", address="127.0.0.1",
        port=port, timeout_s=timeout_s, secret=secret, broadcast=broadcast,
    )  # fmt: skip


@contextmanager
def groups_on_threads(
    world: int, *, broadcast: str, timeout_s: float, secret: str = ""
) -> Iterator[list[Group]]:
    """Every rank of a loopback group, joined on threads of this process (a real store, a
    real transport); each rank's group is released on exit."""
    port = free_port()
    master = host_store("127.0.0.1", port, world, 30)
    stores = [master, *(connect_store("127.0.0.1", port, 30) for _ in range(world - 1))]
    calls = [
        BackgroundCall(join_loopback, stores[r], r, port, world, timeout_s, broadcast, secret)
        for r in range(world)
    ]
    groups = [c.result(30) for c in calls]
    try:
        yield groups
    finally:
        for g in groups:
            release_group(g)
