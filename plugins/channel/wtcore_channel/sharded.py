"""The worker half of a streamed engine's sharded rounds: what tcp and nccl share (the plan,
then one update saying how to reach the trainer ranks); they differ in that update and in how
its pairs travel (:meth:`~ShardedChannelWorker.parse_pairs`, ``receive_pairs``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from wtcore_kit.sharded.pairs import PairAssembler, PlanReceiver, PlanUpdate

__all__ = ["ShardedChannelWorker"]


class ShardedChannelWorker(PlanReceiver):
    """Mixin for a :class:`~wtcore_channel.ChannelWorkerEngine` that executes sharded plans."""

    #: The key of the round's second update (``{"senders": ...}``, ``{"group": ...}``).
    pairs_key: ClassVar[str]
    #: The type :meth:`parse_pairs` returns.
    pairs_update_cls: ClassVar[type]

    @abstractmethod
    def parse_pairs(self, data: Mapping[str, Any]) -> Any:
        """The second update, checked (a ``PayloadError`` naming the field)."""

    @abstractmethod
    def receive_pairs(self, assembler: PairAssembler, update: Any, init: Any) -> None:
        """Receive every pair's buckets into ``assembler``; call :meth:`check_stopped`
        between short waits."""

    def plan_buffer_size_bytes(self) -> int:
        return int(self._joined().packed_buffer_size_bytes)

    def _joined(self) -> Any:
        engine: Any = self
        if engine._init is None:
            raise engine._not_joined()
        return engine._init

    def parse_update_info(self, data: Mapping[str, Any]) -> Any:
        plan = self.parse_plan(data)
        if plan is not None:
            return plan
        if isinstance(data, Mapping) and self.pairs_key in data:
            return self.parse_pairs(data)
        return super().parse_update_info(data)  # type: ignore[misc]

    def receive_weights(self, update_info: Any) -> None:
        if isinstance(update_info, PlanUpdate):
            self.take_plan(update_info)
            return
        if isinstance(update_info, self.pairs_update_cls):
            self._receive_round_pairs(update_info)
            return
        self.refuse_whole_tensors()
        super().receive_weights(update_info)  # type: ignore[misc]

    def _receive_round_pairs(self, update: Any) -> None:
        """Marked as receiving, so an abort or a shutdown ends the waits (and a shutdown
        meanwhile releases the channel once this returns)."""
        engine: Any = self
        assembler = self.planned(f"update_info.{self.pairs_key}")
        init = self._joined()
        with engine._lock:
            engine._receiving = True
        try:
            self.receive_pairs(assembler, update, init)
        finally:
            with engine._lock:
                engine._receiving = False
            if engine._closing.is_set():
                engine._release()
