"""The sender: listens for its workers at every handshake, then streams the round to them.

The round is the kit's (:class:`wtcore_channel.ChannelTrainerEngine`); this engine supplies
its channel, TCP streams to every worker (:mod:`wtcore_channel.stream`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from wtcore_channel import ChannelTrainerEngine
from wtcore_channel.listen import listen_on
from wtcore_channel.stream import Stream, accept
from wtcore_tcp.config import TCPTrainerInitInfo

__all__ = ["TCPTrainerEngine"]


class TCPTrainerEngine(ChannelTrainerEngine):
    """Trainer half of the ``tcp`` engine (see the module docstring)."""

    init_info_cls = TCPTrainerInitInfo

    def open_channel(self) -> tuple[dict[str, Any], Callable[[Callable[[], None]], Stream]]:
        """Listen on ``address`` (the port is the kernel's pick unless set), and draw this
        handshake's token; the workers learn both in the init call and connect back."""
        info = self.info
        assert isinstance(info, TCPTrainerInitInfo)  # init_info_cls, checked by the base class
        listener = listen_on(info.address, info.port, "the tcp stream port", field="")
        token = secrets.token_hex(16)
        port = int(listener.getsockname()[1])

        def join(poll: Callable[[], None]) -> Stream:
            with listener:
                return accept(
                    listener,
                    world_size=info.world_size,
                    token=token,
                    timeout_s=info.timeout_s,
                    poll=poll,
                )

        return info.worker_init_info(port, token).to_wire(), join
