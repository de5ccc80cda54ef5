"""The settings of the ``nccl`` engine pair: what the trainer owns and what it ships to workers.

The worker's :class:`NCCLInitInfo` is derived from the trainer's, so the ends cannot disagree
on the bucket layout.
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


def _check_group(info: NCCLTrainerInitInfo | NCCLInitInfo, transport: str, broadcast: str) -> None:
    if not info.master_address:
        raise PayloadError("master_address: expected a host name or IP address, got ''")
    if not 0 < info.master_port < 65536:
        raise PayloadError(f"master_port: expected a port in [1, 65535], got {info.master_port}")
    if info.world_size < 2:
        raise PayloadError(
            f"world_size: expected at least 2 (the sender plus one worker), got {info.world_size}"
        )
    if transport not in TRANSPORTS:
        raise PayloadError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    check_broadcast(broadcast, transport)


@dataclass
class NCCLTrainerInitInfo(ChannelTrainerInitInfo):
    """Trainer settings of the ``nccl`` engine (docs/nccl.md).

    ``world_size`` counts the sender (trainer rank 0) and every worker (ranks ``1 ..``).
    ``device`` is where the sender stages its buckets, and picks the ``auto`` transport.
    ``torch_num_threads`` (1 for transfer-only processes on small hosts) is ``None`` by
    default because the trainer process also trains. ``broadcast``: ``"auto"`` (the
    collective) or, on NCCL only, ``"chain"``.
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
        _check_group(self, self.resolved_transport, self.resolved_broadcast)
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
        """What every worker receives in ``init_weight_transfer_engine``, under ``secret``."""
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
    """The worker's init info: vLLM's names, plus the timeout, transport and more.

    The defaults of the fields beyond vLLM's are for a third-party trainer that sends only
    those. ``secret`` prefixes every key of the handshake in the sender's store, which anyone
    who reaches its port can use: unguessable keys keep strangers out of the group.
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
        _check_group(self, self.transport, self.broadcast)

    def to_wire(self) -> dict[str, Any]:
        """A JSON-safe dict, as shipped in ``init_weight_transfer_engine``."""
        return asdict(self)


@dataclass
class NCCLUpdateInfo(ChannelUpdateInfo):
    """All tensors of one round, in order; the bytes travel on the group."""
