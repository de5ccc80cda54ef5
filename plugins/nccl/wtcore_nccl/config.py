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
from wtcore.kit import BucketedTrainerInitInfo, BucketUpdateInfo, check_bucket_options
from wtcore_nccl.forward import BROADCASTS

__all__ = [
    "BROADCASTS",
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_DIRECT_MIN_BYTES",
    "DEFAULT_TIMEOUT_S",
    "TRANSPORTS",
    "NCCLInitInfo",
    "NCCLTrainerInitInfo",
    "NCCLUpdateInfo",
    "resolve_broadcast",
    "resolve_transport",
]

#: Default size of one packed bucket buffer (docs/benchmarks.md: 1 GiB made a 1 GiB model one
#: bucket, unpipelined, with 1 GiB of staging on each end; 32-256 MiB measured alike).
DEFAULT_BUFFER_SIZE = 64 << 20
#: Default ``direct_min_bytes`` of the wtcore trainer: tensors this large travel in place.
DEFAULT_DIRECT_MIN_BYTES = 1 << 20
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


def resolve_broadcast(broadcast: str, transport: str, world_size: int, device: str = "cpu") -> str:
    """The concrete broadcast: ``auto`` means, over gloo, the stream to one worker (from a CPU
    ``device``: the stream moves CPU tensors only) and the chain to two or more; the
    collective over NCCL, and over gloo from a GPU.

    Gloo's collective broadcast is a rendezvous per message, which a round of many tensors
    pays once per tensor; a TCP stream has none (docs/benchmarks.md, "nccl engine"). Gloo's
    collective (and the stream) send one copy per worker from the sender's link, so the round
    time grows with the workers; the chain keeps it flat ("Scaling under a bandwidth cap").
    NCCL's own broadcast already pipelines through a ring, so it stays the collective there.
    """
    if broadcast != "auto" and broadcast not in BROADCASTS:
        raise PayloadError(
            f"broadcast: expected auto or one of {', '.join(BROADCASTS)}, got {broadcast!r}"
        )
    if broadcast != "auto":
        return broadcast
    if transport != "gloo":
        return "collective"
    if world_size > 2:
        return "chain"
    return "stream" if str(device) == "cpu" else "collective"


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
    if broadcast not in BROADCASTS:
        raise PayloadError(f"broadcast: expected one of {', '.join(BROADCASTS)}, got {broadcast!r}")
    if broadcast == "stream" and transport == "nccl":
        raise PayloadError(
            "broadcast: 'stream' moves CPU tensors over TCP and needs the gloo transport; "
            "transport is 'nccl' (use 'collective' or 'chain')"
        )


def _check_direct(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PayloadError(f"direct_min_bytes: expected an integer >= 0, got {value!r}")


@dataclass
class NCCLTrainerInitInfo(BucketedTrainerInitInfo):
    """Trainer settings of the ``nccl`` engine.

    ``world_size`` counts every rank of the transfer group: the sender (trainer rank 0) plus
    every inference worker, which join as ranks ``1 .. world_size - 1``. ``device`` is where
    the sender stages its buckets; with ``transport="auto"`` it also picks the transport
    (NCCL for ``cuda*``, gloo otherwise). ``torch_num_threads``, when set, is applied with
    ``torch.set_num_threads`` in the sender: on small hosts torch's busy-waiting worker
    threads starve gloo's network threads (see docs/benchmarks.md), so transfer-only processes
    should use 1. It is ``None`` (leave torch alone) by default because the trainer process
    also trains.

    ``direct_min_bytes``: a tensor at least this large travels as a bucket of its own and, when
    it lies on the group's device, is broadcast straight from its storage and received straight
    into the receiver's parameter (when the sink offers it); 0 packs everything
    (:mod:`wtcore_nccl.plan`). ``checksum``: add a CRC-32 of every bucket to its frame header;
    receivers then verify each bucket before applying it, and stage every bucket to do so
    (:mod:`wtcore_nccl.frames`). Sizes are always checked.

    ``broadcast`` is how bytes reach the workers: ``"collective"`` (the process group's own
    broadcast), ``"chain"`` (workers relay chunks to the next rank, so the sender's link
    carries each byte once; :mod:`wtcore_nccl.forward`) or ``"stream"`` (gloo transport only:
    a TCP stream from the sender to each worker, no rendezvous per message;
    :mod:`wtcore_nccl.stream`). The default, ``"auto"``, is over gloo the stream with one
    worker and the chain with two or more, and the collective over NCCL
    (:func:`resolve_broadcast`); docs/nccl.md says when each wins.
    """

    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = field(default=DEFAULT_BUFFER_SIZE, kw_only=True)
    transport: str = field(default="auto", kw_only=True)
    device: str = field(default="cpu", kw_only=True)
    torch_num_threads: int | None = field(default=None, kw_only=True)
    # In-place transfer and integrity (see wtcore_nccl.plan and wtcore_nccl.frames).
    direct_min_bytes: int = field(default=DEFAULT_DIRECT_MIN_BYTES, kw_only=True)
    checksum: bool = field(default=False, kw_only=True)
    broadcast: str = field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_direct(self.direct_min_bytes)
        if not isinstance(self.checksum, bool):
            raise PayloadError(f"checksum: expected a bool, got {self.checksum!r}")
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
        return resolve_broadcast(
            self.broadcast, self.resolved_transport, self.world_size, self.device
        )

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
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            timeout_s=self.timeout_s,
            transport=self.resolved_transport,
            secret=secret,
            direct_min_bytes=self.direct_min_bytes,
            broadcast=self.resolved_broadcast,
            checksum=self.checksum,
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
    #: Whether the trainer's headers carry CRCs (its ``checksum``); a receiver that posts a
    #: receive before its header arrived (``stream``) stages every bucket when it is set.
    checksum: bool = False

    def __post_init__(self) -> None:
        _check_direct(self.direct_min_bytes)
        if not isinstance(self.checksum, bool):
            raise PayloadError(f"checksum: expected a bool, got {self.checksum!r}")
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
        check_bucket_options(
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
            timeout_s=self.timeout_s,
        )
        if self.rank_offset < 1:
            raise PayloadError(
                f"rank_offset: expected at least 1 (rank 0 is the sender), got {self.rank_offset}"
            )

    def to_wire(self) -> dict[str, Any]:
        """A JSON-safe dict, as shipped in ``init_weight_transfer_engine``."""
        return asdict(self)


@dataclass
class NCCLUpdateInfo(BucketUpdateInfo):
    """All tensors of one round, in order; the bytes travel on the group."""
