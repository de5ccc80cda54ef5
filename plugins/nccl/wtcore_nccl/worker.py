"""The receiver: joins the transfer group the trainer's init names, then receives frames.

The receiving itself is the kit's (:class:`wtcore_channel.ChannelWorkerEngine`); this engine
joins its channel (:mod:`wtcore_nccl.group`). A sharded round's second update
(``{"group": {...}}``) names the round's group, received from point to point
(:mod:`wtcore_nccl.pairs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wtcore.engine import WeightTransferConfig
from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore.parse import parse_dataclass
from wtcore_channel import ChannelWorkerEngine
from wtcore_channel.sharded import ShardedChannelWorker
from wtcore_kit.sharded.pairs import PairAssembler
from wtcore_nccl.chain import check_broadcast
from wtcore_nccl.config import NCCLInitInfo, NCCLUpdateInfo, resolve_transport
from wtcore_nccl.group import GENERATION_KEY, Group, connect_store, join_group
from wtcore_nccl.pairs import GroupUpdate
from wtcore_nccl.status import host_status

if TYPE_CHECKING:
    from wtcore.sink import WeightSink

__all__ = ["WORKER_OPTIONS", "NCCLWorkerEngine"]

_log = logging.getLogger(__name__)


#: Worker-local options (``WeightTransferConfig.options``); nothing here must match the trainer.
WORKER_OPTIONS: tuple[str, ...] = ("torch_num_threads",)


class NCCLWorkerEngine(ShardedChannelWorker, ChannelWorkerEngine[NCCLInitInfo, NCCLUpdateInfo]):
    """Worker half of the ``nccl`` engine; option ``torch_num_threads`` (1 is best for
    transfer-only processes on small hosts, docs/benchmarks.md)."""

    init_info_cls = NCCLInitInfo
    update_info_cls = NCCLUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        *,
        sink: WeightSink,
        device: str = "cpu",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(config, sink=sink, device=device, rank=rank, world_size=world_size)
        unknown = sorted(set(config.options) - set(WORKER_OPTIONS))
        if unknown:
            raise PayloadError(
                f"nccl worker options: unknown {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(WORKER_OPTIONS)}"
            )
        threads = config.options.get("torch_num_threads")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise PayloadError(f"torch_num_threads: expected a positive int, got {threads!r}")
        self._threads: int | None = threads

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    def check_init(self, init_info: NCCLInitInfo) -> None:
        super().check_init(init_info)
        transport = resolve_transport(init_info.transport, self.device)
        if transport == "nccl" and not str(self.device).startswith("cuda"):
            raise PayloadError(
                f"init_info.transport: 'nccl' needs a CUDA device, this worker's device is "
                f"{self.device!r}"
            )
        check_broadcast(init_info.broadcast, transport)

    def open_channel(self, init_info: NCCLInitInfo) -> Group:
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
        addr, port, timeout = init_info.master_address, init_info.master_port, init_info.timeout_s
        store = connect_store(addr, port, timeout, poll=self.check_stopped)
        generation = 0
        if not init_info.secret:
            _log.warning(
                "nccl init without a rendezvous secret (a third-party trainer?): the group's "
                "store keys at %s:%s are guessable, so anyone who reaches that port can join "
                "or break the group",
                addr,
                port,
            )
            generation = self._wait_generation(store, addr, port, timeout)
        return join_group(
            store,
            generation=generation,
            rank=init_info.rank_offset + self.rank,
            world_size=init_info.world_size,
            transport=resolve_transport(init_info.transport, self.device),
            address=addr,
            port=port,
            timeout_s=timeout,
            poll=self.check_stopped,
            secret=init_info.secret,
            broadcast=init_info.broadcast,
        )

    def _wait_generation(self, store: Any, addr: str, port: int, timeout: float) -> int:
        """The handshake counter of a sender without a secret (polled, so abort ends it)."""
        deadline = time.monotonic() + timeout
        while not store.check([GENERATION_KEY]):
            self.check_stopped()
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    f"the nccl rendezvous store at {addr}:{port} announced no handshake "
                    f"within {timeout:g} s"
                )
            time.sleep(0.01)
        try:
            return int(store.get(GENERATION_KEY))
        except ValueError as e:
            raise TransferError(
                f"the nccl rendezvous store at {addr}:{port} holds a malformed handshake "
                f"counter: {e}"
            ) from e

    # ------------------------------------------------------------------ sharded rounds
    pairs_key = "group"
    pairs_update_cls = GroupUpdate

    def parse_pairs(self, data: Mapping[str, Any]) -> GroupUpdate:
        if set(data) != {"group"} or not isinstance(data["group"], Mapping):
            raise PayloadError("update_info: expected {'group': {secret, trainer_ranks}}")
        return parse_dataclass(GroupUpdate, data["group"], what="update_info.group")

    def receive_pairs(self, assembler: PairAssembler, update: Any, init: Any) -> None:
        """Join the round's group as group rank ``M + rank``, receive every pair's buckets, and
        release the group however that ends."""
        from wtcore_nccl.pairs import receive_pairs

        m = update.checked(assembler.trainer_ranks).trainer_ranks
        addr, port, timeout = init.master_address, init.master_port, init.timeout_s
        store = connect_store(addr, port, timeout, poll=self.check_stopped)
        group = join_group(
            store,
            generation=0,
            rank=m + self.rank,
            world_size=m + self.world_size,
            transport=resolve_transport(init.transport, self.device),
            address=addr,
            port=port,
            timeout_s=timeout,
            poll=self.check_stopped,
            secret=update.secret,
        )
        try:
            receive_pairs(
                assembler, group, rank=self.rank, buffers=init.packed_num_buffers,
                buffer_size_bytes=init.packed_buffer_size_bytes, device=self.channel_device,
                timeout_s=timeout, poll=self.check_stopped,
            )  # fmt: skip
        finally:
            group.release()
