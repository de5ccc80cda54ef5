"""The settings of the ``tcp`` engine pair: the trainer's, and the :class:`TCPInitInfo` derived
from them each handshake, so the two ends cannot disagree on the bucket layout."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import PayloadError
from wtcore_channel import ChannelTrainerInitInfo, ChannelUpdateInfo, check_receiver_settings

__all__ = ["TOPOLOGIES", "TCPInitInfo", "TCPTrainerInitInfo", "TCPUpdateInfo", "resolve_topology"]

_TOKEN = re.compile(r"[0-9a-f]{32,128}")
TOPOLOGIES: tuple[str, ...] = ("fanout", "chain")


def resolve_topology(topology: str, world_size: int) -> str:
    """The concrete topology: ``auto`` is the chain for two workers or more (docs/tcp.md)."""
    if topology in TOPOLOGIES:
        return topology
    if topology != "auto":
        raise PayloadError(
            f"topology: expected auto or one of {', '.join(TOPOLOGIES)}, got {topology!r}"
        )
    return "chain" if world_size > 2 else "fanout"


def _check_peers(address: str, port: int, world_size: int, *, any_port: bool) -> None:
    if not isinstance(address, str) or not address:
        raise PayloadError(f"address: expected a host name or IP address, got {address!r}")
    low = 0 if any_port else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port < 65536:
        raise PayloadError(f"port: expected a port in [{low}, 65535], got {port!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise PayloadError(
            f"world_size: expected at least 2 (the sender plus one worker), got {world_size!r}"
        )


@dataclass
class TCPTrainerInitInfo(ChannelTrainerInitInfo):
    """Trainer settings of the ``tcp`` engine (the table in docs/tcp.md)."""

    backend: ClassVar[str] = "tcp"
    address: str
    world_size: int
    port: int = field(default=0, kw_only=True)
    topology: str = field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_peers(self.address, self.port, self.world_size, any_port=True)
        resolve_topology(self.topology, self.world_size)
        if self.device != "cpu":
            raise PayloadError(
                f"device: the tcp engine moves CPU tensors only, got {self.device!r} (use nccl "
                "on CUDA)"
            )

    def worker_init_info(self, port: int, token: str) -> TCPInitInfo:
        return TCPInitInfo(
            address=self.address,
            port=port,
            token=token,
            rank_offset=1,
            world_size=self.world_size,
            topology=resolve_topology(self.topology, self.world_size),
            **self.receiver_settings(),
        )


@dataclass
class TCPInitInfo:
    """The worker's init info. ``token`` proves a connection comes from a worker that got this
    handshake's init call (anyone may reach the port); it is drawn anew every handshake."""

    address: str
    port: int
    token: str = field(repr=False)
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 64 << 20
    packed_num_buffers: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S
    direct_min_bytes: int = 0
    checksum: bool = False
    topology: str = "fanout"

    def __post_init__(self) -> None:
        _check_peers(self.address, self.port, self.world_size, any_port=False)
        if self.topology not in TOPOLOGIES:
            raise PayloadError(f"topology: expected fanout or chain, got {self.topology!r}")
        if not isinstance(self.token, str) or not _TOKEN.fullmatch(self.token):
            raise PayloadError("token: expected 32 to 128 lowercase hex digits")
        check_receiver_settings(self)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TCPUpdateInfo(ChannelUpdateInfo):
    """All tensors of one round, in order; the bytes travel on the streams."""
