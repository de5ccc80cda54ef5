"""The sender: hosts the rendezvous store and joins the transfer group at every handshake.

The round itself (one ``update_weights`` for the whole round, packed buckets from reused
buffers, large tensors in place, frames, bounded drains) is the kit's
(:class:`wtcore_channel.ChannelTrainerEngine`); this engine supplies its channel: a process
group of its own (:mod:`wtcore_nccl.group`), broadcasting collectively or down a forwarding
chain (:mod:`wtcore_nccl.chain`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wtcore_channel import ChannelTrainerEngine
from wtcore_nccl.config import NCCLTrainerInitInfo
from wtcore_nccl.group import GENERATION_KEY, host_store, join_group
from wtcore_nccl.status import host_status

if TYPE_CHECKING:
    from wtcore_channel import Channel

__all__ = ["NCCLTrainerEngine"]


class NCCLTrainerEngine(ChannelTrainerEngine):
    """Trainer half of the ``nccl`` engine (see the module docstring)."""

    init_info_cls = NCCLTrainerInitInfo

    #: The rendezvous store this process hosts, from the first handshake on.
    _store: Any = None

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    def open_channel(self) -> tuple[dict[str, Any], Callable[[Callable[[], None]], Channel]]:
        """A new handshake: a new rendezvous secret (its key prefix in the store), which only
        the receivers learn, inside the init call; the group forms while they are initialized.
        """
        info = self.info
        assert isinstance(info, NCCLTrainerInitInfo)  # init_info_cls, checked by the base class
        if self._store is None:  # the first handshake: this process hosts the rendezvous
            if info.torch_num_threads is not None:
                import torch

                torch.set_num_threads(info.torch_num_threads)
            self._store = host_store(
                info.master_address, info.master_port, info.world_size, info.timeout_s
            )
        generation = int(self._store.add(GENERATION_KEY, 1))
        secret = secrets.token_hex(16)

        def join(poll: Callable[[], None]) -> Channel:
            return join_group(
                self._store,
                generation=generation,
                rank=0,
                world_size=info.world_size,
                transport=info.resolved_transport,
                address=info.master_address,
                port=info.master_port,
                timeout_s=info.timeout_s,
                poll=poll,
                secret=secret,
                broadcast=info.resolved_broadcast,
            )

        return info.worker_init_info(secret).to_wire(), join

    def shutdown(self) -> None:
        """Release the group, the store and the buffers. Idempotent."""
        super().shutdown()
        self._store = None
