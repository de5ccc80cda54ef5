"""The sender: listens for its workers at every handshake, then streams the round to them.

The round is the kit's (:class:`wtcore_channel.ChannelTrainerEngine`); this engine supplies its
channel. A sharded round goes over streams of its own, one per pair (:mod:`wtcore_tcp.pairs`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore_channel import ChannelTrainerEngine
from wtcore_channel.listen import listen_on
from wtcore_tcp.chain import accept_chain
from wtcore_tcp.config import TCPTrainerInitInfo
from wtcore_tcp.streams import Stream, accept

if TYPE_CHECKING:
    from wtcore.sharded.plan import PlannedRound
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats
    from wtcore_kit.concurrency import BackgroundCall

__all__ = ["TCPTrainerEngine"]


class TCPTrainerEngine(ChannelTrainerEngine):
    """Trainer half of the ``tcp`` engine."""

    init_info_cls = TCPTrainerInitInfo

    def open_channel(self) -> tuple[dict[str, Any], Callable[[Callable[[], None]], Stream]]:
        """Listen and draw this handshake's token; the workers learn both in the init call."""
        info = self.info
        assert isinstance(info, TCPTrainerInitInfo)  # init_info_cls, checked by the base class
        listener = listen_on(info.address, info.port, "the tcp stream port", field="")
        token = secrets.token_hex(16)
        wire = info.worker_init_info(int(listener.getsockname()[1]), token)
        accept_all = accept_chain if wire.topology == "chain" else accept

        def join(poll: Callable[[], None]) -> Stream:
            with listener:
                return accept_all(
                    listener,
                    world_size=info.world_size,
                    token=token,
                    timeout_s=info.timeout_s,
                    poll=poll,
                )

        return wire.to_wire(), join

    executes_plans: ClassVar[bool] = True

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Stream this rank's pairs of ``planned``, each on a stream of its own; rank 0 first
        tells the receivers where every rank listens (see :mod:`wtcore_tcp.pairs`)."""
        from wtcore.sharded.round import agree, gather
        from wtcore_kit.concurrency import BackgroundCall
        from wtcore_tcp.pairs import send_pairs

        info = self.info
        assert isinstance(info, TCPTrainerInitInfo)
        rank = info.rank

        def announce(
            mine: dict[str, Any] | None, error: BaseException | None
        ) -> BackgroundCall[Any] | None:
            agree(error, "listening for the receivers")
            every = gather(mine)
            if rank != 0:
                return None
            assert self.client is not None
            return BackgroundCall(
                self.client.update_weights, {"senders": every}, name="update_weights"
            )

        send_pairs(
            planned,
            source,
            stats,
            rank=rank,
            address=info.address,
            port=info.port,
            buffers=info.packed_num_buffers,
            buffer_size_bytes=info.packed_buffer_size_bytes,
            timeout_s=info.timeout_s,
            announce=announce,
        )
