"""One sharded round over many trainer ranks: every rank plans, rank 0 drives the receivers.

Why rank 0 alone makes the four calls: they are the round's control plane, and one owner
keeps the round's id, its abort and its recovery in one place, as for whole tensors. Every
rank computes the same plan (:class:`~wtcore.sharded.plan.PlannedRound`) from the source's
layouts and the receivers' reports, which rank 0 reads (``weight_info()``) and hands to the
others; rank 0 opens the round and sends the plan, every rank then sends its own pairs through
the engine (:meth:`~wtcore.trainer.TrainerWeightTransferEngine.send_pairs`), and rank 0
finishes. Between phases the ranks agree on the outcome in one small collective, so a failure
on any rank fails the round on every rank with the same error, naming the rank, instead of
leaving the others waiting in the next collective; a rank that is gone (killed, crashed)
fails the collective on the others, which raise one error naming it (:func:`_collective`).
Every wait is bounded by the trainer's process group's timeout. A
:class:`~wtcore.sharded.source.ShardedSource` hands this round (:func:`run_sharded_round`) to
the engine's ``send_weights`` as its round driver.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from wtcore.errors import PayloadError, TransferError
from wtcore.sharded.plan import PlannedRound
from wtcore.sharded.receiver_layout import receiver_layouts

if TYPE_CHECKING:
    from wtcore.stats import TransferStats

__all__ = ["PROBE_S", "agree", "gather", "group_rank", "run_sharded_round", "share", "together"]

T = TypeVar("T")

#: How long a trainer rank whose collective failed waits, in a group of more than two, for
#: the others to say through the process group's store that they are still there.
PROBE_S = 5.0
#: What the error of a collective that lost a rank says (a later agreement, which could only
#: fail the same way, passes it on as it is).
_LOST = "(killed, crashed or hung?)"


def group_rank() -> tuple[int, int]:
    """This process's rank and the size of the default process group (0 and 1 without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (one ``broadcast_object_list``)."""
    rank, world = group_rank()
    if world == 1:
        return value
    import torch.distributed as dist

    box = [value if rank == 0 else None]
    _collective("a broadcast from trainer rank 0", lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on rank 0 (``[]`` elsewhere)."""
    rank, world = group_rank()
    if world == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world if rank == 0 else []
    _collective(
        "a gather to trainer rank 0",
        lambda: dist.gather_object(value, out if rank == 0 else None, dst=0),
    )
    return out


def agree(error: BaseException | None, what: str) -> None:
    """Every rank says how its part of ``what`` went; raise on every rank if any failed.

    A rank that failed in its own way raises its own error; where ranks failed differently,
    every failing rank raises one naming them all, since one rank's error is often only the
    echo of another's (a stream the other rank cut)."""
    _, world = group_rank()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if world == 1 or _LOST in (mine or ""):  # alone, or the group already lost a rank
        said = [mine]
    else:
        import torch.distributed as dist

        said = [None] * world
        _collective(what, lambda: dist.all_gather_object(said, mine), mine)
    failed = [(r, m) for r, m in enumerate(said) if m is not None]
    if not failed:
        return
    if error is not None and all(m == mine for _, m in failed):
        raise error  # the same on every rank that failed (a refused plan, say)
    shown = "; ".join(f"trainer rank {r}: {m}" for r, m in failed)
    if error is not None:  # this rank's own failure may only echo another's (a cut stream)
        raise TransferError(f"{what} failed on more than one trainer rank ({shown})") from error
    raise TransferError(f"{what} failed on another trainer rank ({shown})")


def _collective(what: str, call: Callable[[], object], mine: str | None = None) -> None:
    """Run ``call``, a collective of every trainer rank. Why: a rank that is gone (killed,
    crashed, hung) fails it on the others with torch's own error, which names no rank
    (gloo's ``Connection closed by peer [HOST]:PORT``); raise one that names it instead.

    With two ranks it is the other one; with more, those that do not say within
    :data:`PROBE_S` through the process group's store that they are there (each survivor
    says so as its own collective fails). ``mine``: this rank's own failure, kept in the
    message."""
    try:
        call()
    except RuntimeError as e:  # torch's: the ranks' own errors travel as strings
        rank, world = group_rank()
        gone = [1 - rank] if world == 2 else _silent(rank, world)
        said = re.sub(r"^\[[^\]]*\] |\. This is typically.*", "", str(e), flags=re.S)
        who = ", ".join(f"trainer rank {r}" for r in gone) or "no rank (every one answered)"
        own = f"; this rank's own failure: {mine}" if mine else ""
        raise TransferError(
            f"{what} failed on trainer rank {rank}: lost {who} {_LOST}; "
            f"torch.distributed says: {said}{own}"
        ) from e


def _silent(rank: int, world: int) -> list[int]:
    """The trainer ranks that have not said within :data:`PROBE_S`, through the default
    process group's store, that they are there (every rank but those, if it is gone too)."""
    import torch.distributed as dist

    key = "wtcore/sharded/alive/{}".format
    deadline = time.monotonic() + PROBE_S
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(key(rank), "1")
        while True:
            silent = [r for r in range(world) if not store.check([key(r)])]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.05)
    except RuntimeError:  # the store's host (often rank 0) is gone
        return [r for r in range(world) if r != rank]


def together(what: str, call: Callable[[], T] | None) -> T | None:
    """Run ``call`` on this rank (``None``: this rank has no part in ``what``), then
    :func:`agree` on how it went; returns what ``call`` returned."""
    out, error = None, None
    if call is not None:
        try:
            out = call()
        except BaseException as e:
            error = e
    agree(error, what)
    return out


def run_sharded_round(
    engine: Any,
    source: Any,
    stats: TransferStats,
    weight_version: str | None,
) -> None:
    """Run one sharded round on this rank (every trainer rank calls it together).

    ``engine`` is the rank's :class:`~wtcore.trainer.TrainerWeightTransferEngine` (its
    ``init_info``, ``client``, ``send_pairs`` and, on rank 0, the template's start and finish
    of a round), ``source`` the :class:`~wtcore.sharded.source.ShardedSource` whose round
    driver this is (not imported: it imports this).
    """
    from wtcore.client import inspectable

    rank, world = group_rank()
    if rank != engine.init_info.rank:
        raise PayloadError(
            f"rank: the engine is trainer rank {engine.init_info.rank}, the process group's "
            f"rank is {rank}"
        )
    metas = source.metadata()
    client = engine.client

    def read_layouts() -> list[Any]:
        inspecting = inspectable(client)
        if inspecting is None:
            raise PayloadError(
                "a sharded round reads the receivers' layouts: the client must be an "
                "InspectableClient (InProcessClient, the HTTP or the Ray client)"
            )
        return [info.get("layout") for info in inspecting.weight_info()]

    reports = share(together("reading the receivers' layouts", read_layouts if rank == 0 else None))

    def plan() -> PlannedRound:
        layouts = source.layouts()
        if any(lay.world_size != world for lay in layouts.values()):
            raise PayloadError(
                f"layouts: the source lays tensors out over other than the {world} trainer ranks"
            )
        planned = PlannedRound.make(metas, layouts, receiver_layouts(reports, metas))
        stats.num_bytes = planned.plan.nbytes(src=rank)  # this rank's part, planned here
        return planned

    planned = together("planning", plan)
    assert planned is not None
    stats.num_tensors = len(metas)

    def open_round() -> None:
        engine._start_round(stats)
        with stats.phase("control"):
            client.update_weights({"plan": planned.to_wire()})

    def finish() -> None:
        engine._finish_round(stats, weight_version)

    together("opening the round", open_round if rank == 0 else None)
    together("sending the shards", lambda: engine.send_pairs(planned, source, stats))
    together("finishing the round", finish if rank == 0 else None)
