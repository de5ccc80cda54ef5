"""The transfer group: its own rendezvous store and process group, never the default group.

Trainers run FSDP/TP groups of their own, so the group is built from a ``TCPStore`` hosted by
the sender and a ``ProcessGroupGloo``/``ProcessGroupNCCL`` object; ``init_process_group`` is
never called. Each handshake's keys live under its secret (or, from a sender without one, a
guessable generation counter). See docs/nccl.md, "Handshake and the transfer group".
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore_channel.listen import listen_on
from wtcore_nccl.chain import Chain, check_broadcast

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "ABORT_KEY",
    "GENERATION_KEY",
    "IFNAME_ENV",
    "GlooDevice",
    "Group",
    "connect_store",
    "gloo_devices",
    "host_store",
    "join_group",
    "release_group",
    "route_source",
]

#: Store key of the handshake counter; the sender bumps it before each handshake.
GENERATION_KEY = "wtcore/nccl/generation"
#: Key (under a generation's prefix) the sender sets when it abandons a round.
ABORT_KEY = "abort"
#: The interface variable gloo's own default device honors, honored here the same way.
IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_POLL_S = 0.01
#: One attempt of a worker's store connection; it retries until its timeout, polling between.
_CONNECT_TRY_S = 1.0


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def host_store(address: str, port: int, world_size: int, timeout_s: float) -> Any:
    """Host the rendezvous store on the sender, listening on ``address`` only (``TCPStore``
    alone would listen on every interface)."""
    import torch.distributed as dist

    fd = listen_on(address, port, "the nccl rendezvous store").detach()
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            address,
            port,
            world_size,
            True,
            timeout=_td(timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except RuntimeError as e:
        socket.socket(fileno=fd).close()
        text = str(e)
        if "EADDRINUSE" in text or "already in use" in text:
            raise TransferError(
                f"cannot host the nccl rendezvous store at {address}:{port}: the port is "
                "already in use (pick another master_port)"
            ) from e
        raise TransferError(
            f"cannot host the nccl rendezvous store at {address}:{port}: {text}"
        ) from e


def connect_store(
    address: str, port: int, timeout_s: float, poll: Callable[[], None] | None = None
) -> Any:
    """Connect to the sender's store within ``timeout_s``, in short attempts with ``poll``
    (it raises to give up) between them, so a store that never answers cannot hold the caller."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                address, port, None, False, timeout=_td(max(0.05, min(_CONNECT_TRY_S, left)))
            )
        except RuntimeError as e:
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    f"could not reach the nccl rendezvous store at {address}:{port} within "
                    f"{timeout_s:g} s (is the trainer running and is master_address "
                    f"reachable?): {e}"
                ) from e
            if poll is not None:
                poll()
            continue
        store.set_timeout(_td(timeout_s))
        return store


@dataclass
class Group:
    """One generation of the transfer group, as seen by one rank."""

    pg: Any  # ProcessGroupGloo | ProcessGroupNCCL
    store: Any  # the generation's PrefixStore
    rank: int
    world_size: int
    transport: str
    generation: int
    #: ``None`` for the collective broadcast.
    chain: Chain | None = None

    @property
    def checks_sizes(self) -> bool:
        """Never: gloo aborts a receiver given a longer message; receives wait for headers."""
        return False

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start an async broadcast of ``tensor`` from rank 0 (the sender)."""
        import torch.distributed as dist

        if self.chain is not None:
            return self.chain.broadcast(tensor)  # type: ignore[return-value]  # quacks alike
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if self.pg is None:
            raise TransferError("the nccl transfer group was closed")
        work: dist.Work = self.pg.broadcast([tensor], opts)
        return work

    def set_abort(self, reason: str) -> None:
        """Tell the other ranks (best effort) that this generation's round was abandoned."""
        with contextlib.suppress(Exception):  # the store may be gone; the wire errors anyway
            self.store.set(ABORT_KEY, reason[:2000])

    def abort_reason(self) -> str | None:
        """The sender's abort reason for this generation, if it set one."""
        with contextlib.suppress(Exception):
            if self.store.check([ABORT_KEY]):
                return bytes(self.store.get(ABORT_KEY)).decode("utf-8", "replace")
        return None

    def release(self, pending: Iterable[Any] = ()) -> None:
        """Close the group without blocking (:func:`release_group`)."""
        release_group(self, pending)


# ---------------------------------------------------------------- which address gloo advertises
@dataclass(frozen=True)
class GlooDevice:
    """What one gloo device binds to: an ``interface`` name or a local ``hostname`` (address)."""

    interface: str | None = None
    hostname: str | None = None


def gloo_devices(
    master_address: str, master_port: int, environ: Mapping[str, str] | None = None
) -> list[GlooDevice]:
    """The gloo devices this rank binds to, whose addresses its peers must reach (gloo's
    default device resolves the host name, often to loopback): docs/nccl.md, "Across machines"."""
    env = os.environ if environ is None else environ
    if master_address in _LOOPBACK:
        return [GlooDevice(hostname="127.0.0.1")]
    names = [n.strip() for n in env.get(IFNAME_ENV, "").split(",") if n.strip()]
    if names:
        return [GlooDevice(interface=n) for n in names]
    return [GlooDevice(hostname=route_source(master_address, master_port))]


def route_source(address: str, port: int) -> str:
    """The local address that packets to ``address`` leave from (nothing is sent)."""
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise TransferError(f"master_address {address!r} does not resolve: {e}") from e
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                local = str(s.getsockname()[0])
        except OSError as e:
            errors.append(f"{sockaddr[0]}: {e}")
            continue
        return local
    raise TransferError(
        f"no route from this host to master_address {address!r} ({'; '.join(errors)}); "
        f"set {IFNAME_ENV} to the interface that reaches it"
    )


def _make_pg(
    transport: str, store: Any, rank: int, world_size: int, address: str, port: int,
    timeout_s: float,
) -> Any:  # fmt: skip
    import torch.distributed as dist

    if transport == "gloo":
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options()  # type: ignore[attr-defined]
        opts._timeout = _td(timeout_s)
        opts._devices = [
            gloo.create_device(interface=d.interface)
            if d.interface
            else gloo.create_device(hostname=d.hostname)
            for d in gloo_devices(address, port)
        ]
        return gloo(store, rank, world_size, opts)
    if transport == "nccl":  # pragma: no cover - needs CUDA
        nccl = dist.ProcessGroupNCCL
        nopts = nccl.Options()
        nopts._timeout = _td(timeout_s)
        return nccl(store, rank, world_size, nopts)
    raise PayloadError(f"transport: expected 'gloo' or 'nccl', got {transport!r}")


def join_group(
    store: Any,
    *,
    generation: int,
    rank: int,
    world_size: int,
    transport: str,
    address: str,
    port: int,
    timeout_s: float,
    poll: Callable[[], None] | None = None,
    secret: str = "",
    broadcast: str = "collective",
) -> Group:
    """Record this rank's arrival, wait for all ranks, then build the process group.

    ``poll`` runs between short waits and raises to give up. With a ``secret`` the keys live
    under it (``generation`` is not used).
    """
    import torch.distributed as dist

    check_broadcast(broadcast, transport)

    prefix = f"wtcore/nccl/s/{secret}/" if secret else f"wtcore/nccl/g{generation}/"
    gstore = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    if gstore.add(f"arrived/{rank}", 1) != 1:
        raise TransferError(
            f"rank {rank} joined the nccl transfer group at {address}:{port} twice "
            "(two workers configured with the same rank?)"
        )
    keys = [f"arrived/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not gstore.check(keys):
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            arrived = [r for r in range(world_size) if gstore.check([f"arrived/{r}"])]
            missing = sorted(set(range(world_size)) - set(arrived))
            raise TransferTimeoutError(
                f"nccl transfer group at {address}:{port} (world_size {world_size}) did not "
                f"form within {timeout_s:g} s: ranks {arrived} arrived, ranks {missing} "
                "never did (is world_size right, and did every worker get the init call?)"
            )
        time.sleep(_POLL_S)
    try:
        pg = _make_pg(
            transport,
            dist.PrefixStore("pg/", gstore),  # type: ignore[attr-defined]
            rank,
            world_size,
            address,
            port,
            timeout_s,
        )
    except RuntimeError as e:
        raise TransferError(
            f"building the {transport} process group at {address}:{port} "
            f"(rank {rank} of {world_size}) failed: {e}"
        ) from e
    chain = Chain(pg, rank, world_size) if broadcast == "chain" else None
    return Group(pg, gstore, rank, world_size, transport, generation, chain)


def release_group(group: Group | None, pending: Iterable[dist.Work] = ()) -> None:
    """Close ``group`` without blocking the caller.

    gloo closes its connections only once the process group *and* all its ``Work`` are gone,
    and destroying a group waits for its unfinished operations; so a group with ``pending``
    work goes to a daemon thread that lets go once that work ends. Callers reach the process
    group only through :class:`Group`, so this reference is the one that counts.
    """
    if group is None or group.pg is None:
        return
    pg, group.pg = group.pg, None
    if group.chain is not None:
        group.chain.close()
    works = [w for w in pending if not w.is_completed()]
    if not works:
        del pg
        return

    def _reap(pg: Any = pg, works: list[dist.Work] = works) -> None:
        for w in works:
            with contextlib.suppress(Exception):  # the failure was already reported to the user
                w.wait()
        works.clear()
        del pg

    del pg
    threading.Thread(target=_reap, name="wtcore-nccl-reaper", daemon=True).start()
