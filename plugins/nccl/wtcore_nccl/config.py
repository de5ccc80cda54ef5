"""The settings of the ``nccl`` engine pair: what the trainer owns and what it ships to workers.

The trainer's :class:`NCCLTrainerInitInfo` is the only place where packing settings are
chosen; :meth:`NCCLTrainerInitInfo.worker_init_info` derives the worker's
:class:`NCCLInitInfo` from it, so the two ends cannot disagree on the bucket layout.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import PayloadError
from wtcore_channel import (
    DEFAULT_BUFFER_SIZE,
    ChannelTrainerInitInfo,
    ChannelUpdateInfo,
    check_receiver_settings,
)
from wtcore_nccl.chain import BROADCASTS, check_broadcast

__all__ = [
    "BROADCASTS",
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_TIMEOUT_S",
    "TRANSPORTS",
    "NCCLInitInfo",
    "NCCLTrainerInitInfo",
    "NCCLUpdateInfo",
    "resolve_transport",
]

#: What a rendezvous secret looks like (``secrets.token_hex(16)`` and longer).
_SECRET = re.compile(r"[0-9a-f]{32,128}")
#: ``auto`` picks NCCL for CUDA devices and gloo otherwise.
TRANSPORTS: tuple[str, ...] = ("auto", "gloo", "nccl")


def resolve_transport(transport: str, device: str) -> str:
    """The concrete transport for ``device``: ``auto`` means NCCL on CUDA, gloo elsewhere."""
    if transport not in TRANSPORTS:
        raise PayloadError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport != "auto":
        return transport
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _check_group(
    *, master_address: str, master_port: int, world_size: int, transport: str, broadcast: str
) -> None:
    if not master_address:
        raise PayloadError("master_address: expected a host name or IP address, got ''")
    if not 0 < master_port < 65536:
        raise PayloadError(f"master_port: expected a port in [1, 65535], got {master_port}")
    if world_size < 2:
        raise PayloadError(
            f"world_size: expected at least 2 (the sender plus one worker), got {world_size}"
        )
    if transport not in TRANSPORTS:
        raise PayloadError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    check_broadcast(broadcast, transport)


@dataclass
class NCCLTrainerInitInfo(ChannelTrainerInitInfo):
    """Trainer settings of the ``nccl`` engine.

    ``world_size`` counts every rank of the transfer group: the sender (trainer rank 0) plus
    every inference worker, which join as ranks ``1 .. world_size - 1``. ``device`` is where
    the sender stages its buckets; with ``transport="auto"`` it also picks the transport
    (NCCL for ``cuda*``, gloo otherwise). ``torch_num_threads``, when set, is applied with
    ``torch.set_num_threads`` in the sender: on small hosts torch's busy-waiting worker
    threads starve gloo's network threads (see docs/benchmarks.md), so transfer-only processes
    should use 1. It is ``None`` (leave torch alone) by default because the trainer process
    also trains.

    ``direct_min_bytes`` and ``checksum`` are the kit's
    (:class:`wtcore_channel.ChannelTrainerInitInfo`).

    ``broadcast`` is how bytes reach the workers: ``"collective"`` (the process group's own
    broadcast; ``"auto"``, the default) or, on NCCL only, ``"chain"`` (workers relay chunks to
    the next rank, so the sender's link carries each byte once; :mod:`wtcore_nccl.chain`).
    """

    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    transport: str = field(default="auto", kw_only=True)
    torch_num_threads: int | None = field(default=None, kw_only=True)
    broadcast: str = field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            _check_group(
                master_address=self.master_address,
                master_port=self.master_port,
                world_size=self.world_size,
                transport=self.resolved_transport,
                broadcast=self.resolved_broadcast,
            )
        except ValueError as e:
            raise PayloadError(str(e)) from None
        if self.torch_num_threads is not None and self.torch_num_threads < 1:
            raise PayloadError(
                f"torch_num_threads: expected None or at least 1, got {self.torch_num_threads}"
            )

    @property
    def resolved_transport(self) -> str:
        return resolve_transport(self.transport, self.device)

    @property
    def resolved_broadcast(self) -> str:
        return "collective" if self.broadcast == "auto" else self.broadcast

    def worker_init_info(self, secret: str = "") -> NCCLInitInfo:
        """What every worker receives in ``init_weight_transfer_engine`` (rank offset 1).

        ``secret`` is the handshake's rendezvous secret (the sender draws a new one for every
        handshake; see :class:`NCCLInitInfo`).
        """
        return NCCLInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            rank_offset=1,
            world_size=self.world_size,
            transport=self.resolved_transport,
            secret=secret,
            broadcast=self.resolved_broadcast,
            **self.receiver_settings(),
        )


@dataclass
class NCCLInitInfo:
    """The worker's init info (vLLM's names, plus the timeout and the transport).

    ``transport`` defaults to ``auto`` (NCCL if the worker's device is CUDA, else gloo) so a
    third-party trainer that sends only the vLLM fields still works; the wtcore trainer
    always sends the transport it resolved, so both ends use the same one.

    ``secret`` is the rendezvous secret: the prefix of every key this handshake uses in the
    sender's store. The store takes connections from anyone who can reach its port, so keys
    that a stranger cannot guess are what keeps it from joining or poisoning the group; the
    secret travels only inside this (authenticated) init call. The wtcore trainer draws a new
    one for every handshake. It is optional so that a trainer that sends only the vLLM fields
    still works, with guessable keys (a warning is logged).

    ``broadcast`` is the trainer's choice (see :class:`NCCLTrainerInitInfo`); a trainer that
    sends only the vLLM fields gets the collective broadcast.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = True
    #: What a trainer that leaves it out means (vLLM's default); the wtcore trainer sends its own.
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S
    transport: str = "auto"
    secret: str = field(default="", repr=False)
    #: 0 (the plain packing rule) for a trainer that does not send it.
    direct_min_bytes: int = 0
    broadcast: str = "collective"
    #: Whether the trainer's frame headers carry CRCs (its ``checksum``).
    checksum: bool = False

    def __post_init__(self) -> None:
        check_receiver_settings(self)
        if self.secret and not _SECRET.fullmatch(self.secret):
            raise PayloadError(
                "secret: expected 32 to 128 lowercase hex digits (or '' for none), got "
                f"{len(self.secret)} characters that are not"
            )
        _check_group(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.world_size,
            transport=self.transport,
            broadcast=self.broadcast,
        )

    def to_wire(self) -> dict[str, Any]:
        """A JSON-safe dict, as shipped in ``init_weight_transfer_engine``."""
        return asdict(self)


@dataclass
class NCCLUpdateInfo(ChannelUpdateInfo):
    """All tensors of one round, in order; the bytes travel on the group."""
