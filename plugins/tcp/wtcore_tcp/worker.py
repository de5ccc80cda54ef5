"""The receiver: connects to the sender the trainer's init names, then receives frames.

The receiving is the kit's (:class:`wtcore_channel.ChannelWorkerEngine`); this engine joins
its channel, the sender's TCP streams (:mod:`wtcore_channel.stream`). A sharded round takes
its plan first (:class:`wtcore.pairs.PlanReceiver`), then where every trainer rank listens,
and reads each one's stream (:mod:`wtcore_tcp.pairs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wtcore.errors import PayloadError
from wtcore.pairs import PlanReceiver, PlanUpdate
from wtcore.parse import parse_dataclass
from wtcore_channel import ChannelWorkerEngine
from wtcore_channel.stream import Stream, connect
from wtcore_tcp.config import TCPInitInfo, TCPUpdateInfo
from wtcore_tcp.pairs import SendersUpdate

__all__ = ["TCPWorkerEngine"]


class TCPWorkerEngine(PlanReceiver, ChannelWorkerEngine[TCPInitInfo, TCPUpdateInfo]):
    """Worker half of the ``tcp`` engine (see the module docstring): sockets move host
    memory, so a CUDA worker's buckets are staged there."""

    init_info_cls = TCPInitInfo
    update_info_cls = TCPUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.options:
            unknown = ", ".join(map(repr, sorted(self.config.options)))
            raise PayloadError(f"tcp worker options: unknown {unknown}; the tcp worker has none")

    @property
    def channel_device(self) -> str:
        """Host memory: sockets read into it. On a CUDA worker every bucket is staged there
        and the sink copies it to the GPU (nccl moves GPU memory without the stop)."""
        return "cpu"

    def check_init(self, init_info: TCPInitInfo) -> None:
        super().check_init(init_info)
        if str(self.device).split(":")[0] not in ("cpu", "cuda"):
            raise PayloadError(
                f"device: the tcp engine receives into host memory for CPU or CUDA workers, "
                f"this worker's device is {self.device!r}"
            )

    def open_channel(self, init_info: TCPInitInfo) -> Stream:
        return connect(
            init_info.address,
            init_info.port,
            rank=init_info.rank_offset + self.rank,
            token=init_info.token,
            timeout_s=init_info.timeout_s,
            poll=self.check_stopped,
        )

    # ------------------------------------------------------------------ sharded rounds
    def plan_buffer_size_bytes(self) -> int:
        init = self._init
        if init is None:
            raise self._not_joined()
        return init.packed_buffer_size_bytes

    def parse_update_info(self, data: Mapping[str, Any]) -> Any:
        plan = self.parse_plan(data)
        if plan is not None:
            return plan
        if isinstance(data, Mapping) and "senders" in data:
            return parse_dataclass(SendersUpdate, data, what="update_info")
        return super().parse_update_info(data)

    def start_weight_update(self) -> None:
        self.drop_plan()
        super().start_weight_update()

    def abort(self) -> None:
        self.drop_plan()
        super().abort()

    def finish_weight_update(self) -> None:
        self.check_planned_round()

    def receive_weights(self, update_info: Any) -> None:
        if isinstance(update_info, PlanUpdate):
            self.take_plan(update_info)
            return
        if isinstance(update_info, SendersUpdate):
            self._receive_pairs(update_info)
            return
        self.refuse_whole_tensors()
        super().receive_weights(update_info)

    def _receive_pairs(self, update: SendersUpdate) -> None:
        """Connect to every trainer rank this receiver gets bytes from and assemble them;
        an abort or a shutdown ends the wait within about 50 ms."""
        from wtcore_tcp.pairs import receive_pairs

        assembler = self.planned("update_info.senders")
        init = self._init
        if init is None:
            raise self._not_joined()
        senders = update.checked(assembler.trainer_ranks)
        with self._lock:
            self._receiving = True
        try:
            receive_pairs(
                assembler, senders, rank=self.rank, timeout_s=init.timeout_s,
                poll=self.check_stopped,
            )  # fmt: skip
        finally:
            with self._lock:
                self._receiving = False
            if self._closing.is_set():
                self._release()
