"""The receiver: connects to the sender the trainer's init names, then receives frames.

The receiving is the kit's (:class:`wtcore_channel.ChannelWorkerEngine`); this engine joins its
channel. A sharded round reads each trainer rank's own stream (:mod:`wtcore_tcp.pairs`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from wtcore.errors import PayloadError
from wtcore.parse import parse_dataclass
from wtcore_channel import ChannelWorkerEngine
from wtcore_channel.sharded import ShardedChannelWorker
from wtcore_kit.sharded.pairs import PairAssembler
from wtcore_tcp.chain import connect_chain
from wtcore_tcp.config import TCPInitInfo, TCPUpdateInfo
from wtcore_tcp.pairs import SendersUpdate
from wtcore_tcp.streams import Stream, connect

__all__ = ["TCPWorkerEngine"]


class TCPWorkerEngine(ShardedChannelWorker, ChannelWorkerEngine[TCPInitInfo, TCPUpdateInfo]):
    """Worker half of the ``tcp`` engine."""

    init_info_cls = TCPInitInfo
    update_info_cls = TCPUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.options:
            unknown = ", ".join(map(repr, sorted(self.config.options)))
            raise PayloadError(f"tcp worker options: unknown {unknown}; the tcp worker has none")

    @property
    def channel_device(self) -> str:
        """Sockets read host memory: a CUDA worker's buckets are staged there."""
        return "cpu"

    def check_init(self, init_info: TCPInitInfo) -> None:
        super().check_init(init_info)
        if str(self.device).split(":")[0] not in ("cpu", "cuda"):
            raise PayloadError(
                f"device: the tcp engine receives into host memory for CPU or CUDA workers, "
                f"this worker's device is {self.device!r}"
            )

    def open_channel(self, init_info: TCPInitInfo) -> Stream:
        i = init_info
        chain = i.topology == "chain"
        join = functools.partial(connect_chain, world_size=i.world_size) if chain else connect
        return join(
            i.address, i.port, rank=i.rank_offset + self.rank, token=i.token,
            timeout_s=i.timeout_s, poll=self.check_stopped,
        )  # fmt: skip

    # ------------------------------------------------------------------ sharded rounds
    pairs_key = "senders"
    pairs_update_cls = SendersUpdate

    def parse_pairs(self, data: Mapping[str, Any]) -> SendersUpdate:
        return parse_dataclass(SendersUpdate, data, what="update_info")

    def receive_pairs(self, assembler: PairAssembler, update: Any, init: Any) -> None:
        """Connect to every trainer rank this receiver gets bytes from and assemble them."""
        from wtcore_tcp.pairs import receive_pairs

        senders = update.checked(assembler.trainer_ranks)
        receive_pairs(
            assembler, senders, rank=self.rank, timeout_s=init.timeout_s, poll=self.check_stopped
        )
