"""The sender: hosts the rendezvous store and joins the transfer group at every handshake.

The round itself is the kit's (:class:`wtcore_channel.ChannelTrainerEngine`); this engine
supplies its channel (:mod:`wtcore_nccl.group`), and sends sharded rounds point to point
(:mod:`wtcore_nccl.pairs`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from wtcore_channel import ChannelTrainerEngine
from wtcore_nccl.config import NCCLTrainerInitInfo
from wtcore_nccl.group import GENERATION_KEY, host_store, join_group
from wtcore_nccl.status import host_status

if TYPE_CHECKING:
    from wtcore.sharded.plan import PlannedRound
    from wtcore.source import WeightSource
    from wtcore.stats import TransferStats
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
        """A new handshake under a new secret, which only the receivers learn (in the init call)."""
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

    executes_plans: ClassVar[bool] = True

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Send this rank's pairs of ``planned`` in this round's group of every trainer rank
        and receiver (docs/nccl.md, "Sharded rounds").

        The ranks read their parts and agree before any group forms, so a broken source fails
        the round everywhere without a rank left waiting for it. The receivers' update runs in
        the background: their ``update_weights`` returns only once they received everything.
        """
        from wtcore.sharded.round import share, together
        from wtcore_kit.concurrency import BackgroundCall
        from wtcore_nccl.group import connect_store
        from wtcore_nccl.pairs import RoundTerms, check_terms, send_pairs

        info = self.info
        assert isinstance(info, NCCLTrainerInitInfo)
        rank = info.rank
        trainer_ranks = planned.senders[0].world_size if planned.senders else 1
        secret = secrets.token_hex(16) if rank == 0 else None
        local = together("reading the shards", lambda: dict(source)) or {}
        terms = RoundTerms(
            planned.plan.digest(), info.packed_buffer_size_bytes, info.packed_num_buffers
        )
        secret, rank0 = share((secret, terms))

        def reach() -> Any:
            check_terms(terms, RoundTerms(*rank0), rank)
            if rank == 0:
                return self._store
            # the other trainer ranks reach rank 0's store as clients
            return connect_store(info.master_address, info.master_port, info.timeout_s)

        store = together(
            "agreeing on the round's terms and reaching the nccl rendezvous store", reach
        )
        rpc: BackgroundCall[Any] | None = None
        if rank == 0:
            assert self.client is not None
            update = {"group": {"secret": secret, "trainer_ranks": trainer_ranks}}
            rpc = BackgroundCall(self.client.update_weights, update, name="update_weights")

        def poll() -> None:
            if rpc is not None and rpc.error is not None:
                raise rpc.error

        group = join_group(
            store,
            generation=0,
            rank=rank,
            world_size=trainer_ranks + info.world_size - 1,
            transport=info.resolved_transport,
            address=info.master_address,
            port=info.master_port,
            timeout_s=info.timeout_s,
            poll=poll,
            secret=secret,
        )
        try:
            send_pairs(
                planned, local, stats, group, rank=rank, buffers=info.packed_num_buffers,
                buffer_size_bytes=info.packed_buffer_size_bytes, device=str(info.device),
                timeout_s=info.timeout_s, poll=poll,
            )  # fmt: skip
        finally:
            group.release()
        if rpc is not None:
            with stats.phase("control"):
                rpc.result(info.timeout_s)

    def shutdown(self) -> None:
        """Release the group, the store and the buffers. Idempotent."""
        super().shutdown()
        self._store = None
