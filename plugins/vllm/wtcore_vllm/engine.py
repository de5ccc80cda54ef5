"""The adapter: vLLM's worker-side weight-transfer engine on top of a wtcore worker engine.

It forwards every protocol call to the wtcore engine its backend names (parsing is wtcore's),
whose sink feeds ``model.load_weights`` inside vLLM's layerwise reload (:mod:`wtcore_vllm.reload`).
What it adds, and why (round ownership from the ``update_info`` stamp, finish checks, staged and
LoRA rounds, TP workers as sharded receivers that fail together): docs/vllm.md, "What the adapter
does" and "Tensor parallelism".
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from functools import cache
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from wtcore.engine import WeightTransferConfig
from wtcore.errors import PayloadError, ProtocolStateError, TransferError
from wtcore.registry import ENGINES
from wtcore.rounds import PREPARE_KEY, ROUND_KEY, STAGED_KEY, drop_round, round_stamp
from wtcore.stats import ROUND_TIMES
from wtcore_kit.concurrency import BackgroundCall
from wtcore_kit.sharded.pairs import PlanUpdate
from wtcore_vllm.checker import install as install_kernel_checksums
from wtcore_vllm.lora import LoRAWriter, lora_round
from wtcore_vllm.names import vllm_backend_name, wtcore_engine_name
from wtcore_vllm.paths import weight_transfer
from wtcore_vllm.reload import (
    TiedLayers,
    abort_layerwise_reload,
    check_layerwise_reload,
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from wtcore_vllm.tp import TPModelSink, derive_layout

#: vLLM's engine base class, from wherever this vLLM keeps it (:mod:`wtcore_vllm.paths`).
VLLMEngine: Any = weight_transfer("base").WeightTransferEngine

if TYPE_CHECKING:
    from wtcore.engine import WeightTransferEngine as WtcoreEngine

__all__ = ["ModelSink", "WtcoreVLLMEngine", "adapter_class", "worker_place"]

log = logging.getLogger(__name__)

#: The owner of a round before its first update has said who it is.
_UNBOUND = object()
#: How long a prepare or finish waits for the round's receiving thread: the receive bounds
#: each of its own waits, so this only ends one stuck by a bug.
_RECEIVE_JOIN_S = 3600.0
_ABORT_WAIT_S = 60.0  # engines end an aborted receive within about 50 ms


class ModelSink:
    """A sink over the adapter's current target model (read per call, for draft models). No
    delta patches: the layerwise reload rebuilds layers from whole checkpoint tensors."""

    accepts_patches = False

    def __init__(self, adapter: WtcoreVLLMEngine) -> None:
        self._adapter = adapter

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Copies: wtcore engines reuse their receive buffers, and the layerwise reload keeps
        # a layer's tensors until the layer is complete.
        model: Any = self._adapter.model  # a vLLM model class; nn.Module does not declare it
        model.load_weights((name, t.clone()) for name, t in weights)


def worker_place(parallel_config: Any) -> tuple[int, int]:
    """``(rank, world_size)`` among every inference worker, numbered as vLLM's NCCL engine
    does: ``dp_index * (tp * pp) + rank``."""
    per_replica = int(parallel_config.world_size)
    dp_index = int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    dp_size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    rank = dp_index * per_replica + int(parallel_config.rank)
    return rank, dp_size * per_replica


@contextlib.contextmanager
def _no_mtp_completeness_check() -> Iterator[None]:
    """vLLM's NCCL engine receives inside this: a round may carry only part of a model."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


class _Staging:
    """The engine's sink: forwards to ``live``, or while :attr:`on` (a staged round) copies
    each tensor into a host buffer per checkpoint name, kept between rounds."""

    accepts_patches = False  # as ModelSink

    def __init__(self, live: Any, pin: bool) -> None:
        self.live, self.pin, self.on = live, pin, False
        self.buffers: dict[str, torch.Tensor] = {}
        self.round: dict[str, None] = {}  # this round's names, in arrival order

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.on:
            self.live.load_weights(weights)
            return
        with torch.no_grad():
            for name, t in weights:
                buf = self.buffers.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
                    self.buffers[name] = buf
                buf.copy_(t)
                self.round[name] = None

    def commit(self, load: Any) -> None:
        """``load`` this round's buffers uncopied (none is written before the next round, and
        vLLM copies what it keeps); free the others."""
        staged, self.round, self.on = self.round, {}, False
        self.buffers = {n: self.buffers[n] for n in staged}
        load([(n, self.buffers[n]) for n in staged])

    def drop(self) -> None:
        self.round, self.on = {}, False


class WtcoreVLLMEngine(VLLMEngine):
    """Delegates to the wtcore engine :attr:`wtcore_engine` (set by :func:`adapter_class`),
    else the one ``config.backend`` names."""

    wtcore_engine: str | None = None

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        if torch.device(device).type == "cpu":
            install_kernel_checksums()
        name = self.wtcore_engine or wtcore_engine_name(str(config.backend))
        rank, world_size = worker_place(self.parallel_config)
        engine_cls = ENGINES.load(name)
        self.tp_sink: TPModelSink | None = None
        #: Why this TP worker cannot take sharded rounds (``None``: it can, or TP = 1).
        self.layout_error: str | None = None
        sink: ModelSink | TPModelSink = ModelSink(self)
        tp_size = self._tp_size = int(getattr(self.parallel_config, "tensor_parallel_size", 1) or 1)
        if tp_size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            try:
                derived = derive_layout(model, int(get_tensor_model_parallel_rank()), tp_size)
            except PayloadError as e:
                # Whole-tensor rounds still work (vLLM's loaders narrow them); sharded rounds
                # are refused with this reason, which the worker reports too.
                self.layout_error = str(e)
                log.warning("this TP worker refuses sharded rounds: %s", e)
            else:
                sink = self.tp_sink = TPModelSink(self, derived)
        self._staging = _Staging(sink, pin=torch.device(device).type == "cuda")
        self.inner: WtcoreEngine[Any, Any] = engine_cls(
            WeightTransferConfig(name),
            sink=self._staging,
            device=str(device),
            rank=rank,
            world_size=world_size,
        )
        if self.tp_sink is not None:
            self.inner.receiver_layout = self.tp_sink.derived.layout
        self.init_info_cls = engine_cls.init_info_cls
        self.update_info_cls = engine_cls.update_info_cls
        self._reloading = self._open = self._prepared = False
        self._owner: object = _UNBOUND
        self._staged: bool | None = None  # said by the round's first update
        self._lora: LoRAWriter | None = None  # an adapter round's (wtcore_vllm.lora)
        self._started_at = self._blocked_s = 0.0
        self._live_from: float | None = None
        self._receiving: BackgroundCall[None] | None = None  # a staged round's (_receive_off_loop)
        #: The last finished round's seconds (docs/staged.md), as wtcore's worker reports them.
        self.round_times: dict[str, float | None] = dict.fromkeys(ROUND_TIMES)

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        return self.inner.parse_init_info(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        return self.inner.parse_update_info(update_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        if self._open:  # a trainer's fresh init abandons the round a failed one left open
            self._abort_round()
            self._end_vllm_session()
        self.inner.init_transfer_engine(init_info)

    def worker_info(self) -> dict[str, Any]:
        """This worker's report (:mod:`wtcore_vllm.extension`): its place, layout (``None`` at
        TP = 1), last round's seconds, and at TP > 1 its last sharded round's bytes."""
        layout = self.inner.receiver_layout
        out: dict[str, Any] = {
            "rank": self.inner.rank,
            "world_size": self.inner.world_size,
            "layout": None if layout is None else layout.to_wire(),
            **self.round_times,
        }
        if self.tp_sink is not None:
            planned, landed = self.tp_sink.planned_bytes, self.tp_sink.landed_bytes
            out["round_bytes"] = {"planned": planned, "landed": landed}
        if self.layout_error is not None:
            out["layout_error"] = self.layout_error
        return out

    def start_weight_update(self) -> None:
        self._abort_round()  # a round vLLM gave up on without telling the engine
        self.inner.start_weight_update()
        if self.tp_sink is not None:
            self.tp_sink.start()
        self._owner, self._staged, self._prepared, self._lora = _UNBOUND, None, False, None
        self._open, self._started_at, self._live_from = True, time.monotonic(), None
        self._blocked_s = 0.0

    def _begin_reload(self) -> None:
        """vLLM's layerwise reload: from here the live model is no published version."""
        self._live_from = time.monotonic()
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        error: BaseException | None = None
        t0 = time.monotonic()
        try:
            self._check_owner(round_stamp(update_info))
            update_info, lora = lora_round(self, update_info)
            if self._staged is None:  # the round's first update says which round it is
                self._lora = lora  # an adapter round is staged, and commits to its folder
                self._staged = self._staging.on = update_info.get(STAGED_KEY) is True or bool(lora)
                if not self._staged:
                    self._begin_reload()
            if self._prepared:
                raise ProtocolStateError(
                    "update_weights: refused, this round was prepared; only its finish may follow"
                )
            if PREPARE_KEY in update_info:
                if not self._staged:
                    raise PayloadError(f"update_info.{PREPARE_KEY}: only a staged round prepares")
                self._check_round()  # every check the commit does not need the model for
                self._prepared = True
            else:
                update = self.parse_update_info(drop_round(update_info))
                if self._staged and self.inner.receives_after_return(update):
                    self._receive_off_loop(update)
                else:
                    self._receive(update)
        except BaseException as e:
            error = e
        finally:
            self._blocked_s += time.monotonic() - t0
        failed, raise_here = self._agree(error, "update_weights")
        if not failed:
            return
        self._abort_round()
        if raise_here is None:
            # Another worker raises for all (_agree), and vLLM closes only its session.
            self._end_vllm_session()
            return
        raise raise_here

    def _check_owner(self, stamped: str | None) -> None:
        """Bind the round to its first update's id; refuse any later update of another."""
        if self._owner is _UNBOUND:
            self._owner = stamped
            return
        owner = self._owner
        if owner is None and stamped is None:
            return
        if isinstance(owner, str) and stamped is not None and hmac.compare_digest(owner, stamped):
            return
        whose = "an owned round" if owner is not None else "an unowned round"
        has = f"another round's id in {ROUND_KEY}" if stamped is not None else "no round id"
        raise ProtocolStateError(
            f"update_weights: refused, this is {whose} and the update carries {has} (a second "
            "trainer, or a stale call); nothing of it was applied, and vLLM ends the round"
        )

    def _receive(self, update: Any) -> None:
        self.receive_weights(update)
        if self.device.type != "cpu":
            # Like vLLM's base class: the next step must see the new weights.
            torch.accelerator.synchronize()

    def _receive_off_loop(self, update: Any) -> None:
        """Receive a staged round's update on a thread, after the one before it, so vLLM's
        engine loop goes on generating; the prepare or finish waits for it (:meth:`_received`)."""
        before = self._receiving

        def receive() -> None:
            if before is not None:
                before.result(_RECEIVE_JOIN_S)
            self._receive(update)

        self._receiving = BackgroundCall(receive, name="receive_weights")

    def _received(self) -> None:
        """Wait for the round's receives on threads; re-raise what failed there."""
        call, self._receiving = self._receiving, None
        if call is not None:
            call.result(_RECEIVE_JOIN_S)

    def receive_weights(self, update_info: Any) -> None:
        if self.layout_error is not None and isinstance(update_info, PlanUpdate):
            raise PayloadError(
                f"update_info.plan: this vLLM worker (TP rank of a group of "
                f"{self.parallel_config.tensor_parallel_size}) takes no sharded rounds: "
                f"{self.layout_error}"
            )
        if self.tp_sink is not None and isinstance(update_info, PlanUpdate):
            self.tp_sink.take_plan(sum(m.nbytes for m in update_info.metas))
        with _no_mtp_completeness_check():
            self.inner.receive_weights(update_info)

    def _check_round(self) -> None:
        """What a finish checks before it writes the live model (a staged round's prepare)."""
        self._received()
        if self._staged is None or (self._staged and not self._staging.round):
            raise ProtocolStateError("refused, this round loaded no tensors; nothing is published")
        self.inner.finish_weight_update()

    def finish_weight_update(self) -> None:
        error: BaseException | None = None
        tied = TiedLayers()
        t0 = time.monotonic()
        try:
            if not self._prepared:
                self._check_round()
            if self._staged:  # the commit: the reload, fed from the staging
                self._blocked_s += time.monotonic() - t0
                t0 = time.monotonic()
                model: Any = self.model  # a vLLM model class: nn.Module declares no load_weights
                if self._lora is not None:  # the base weights stay as they are
                    self._staging.commit(self._lora.save)
                else:
                    self._begin_reload()
                    self._staging.commit(
                        self.tp_sink.load_weights if self.tp_sink else model.load_weights
                    )
            if self.tp_sink is not None and self.tp_sink.sharded:
                self.tp_sink.check_complete()
            if self._reloading:
                tied = check_layerwise_reload(self.model, self.model_config)  # nothing: raises
        except BaseException as e:
            error = e
        # Every worker of the TP group commits, or none does.
        failed, raise_here = self._agree(error, "finish_weight_update")
        if failed:
            self._abort_round()
            if raise_here is None:
                return  # another worker raises for all; vLLM closes this worker's session
            self._end_vllm_session()
            raise raise_here
        try:
            if self._reloading:
                self._reloading = False
                finalize_layerwise_reload(self.model, self.model_config, tied)
        except BaseException:
            self._abort_round()
            self._end_vllm_session()
            raise
        self._open, end = False, time.monotonic()
        # Staged: the engine loop stood still in the round's calls (a receive in one, a wait
        # for the receiving thread) and in the commit; classic: from the first write on.
        paused = end - t0 + self._blocked_s if self._staged else end - (self._live_from or t0)
        staged = t0 - self._started_at if self._staged else None
        self.round_times = {"staged_s": staged, "commit_s": end - t0, "paused_s": paused}

    def _agree(self, error: BaseException | None, step: str) -> tuple[bool, BaseException | None]:
        """Whether ``step`` failed on any worker of this TP group, and what this worker raises:
        only the last one does, for all, since vLLM 0.32 stops reading replies at the first
        failure and would leave the others queued (docs/vllm.md, "Tensor parallelism")."""
        if self._tp_size == 1:
            return error is not None, error
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        mine = None if error is None else f"{type(error).__name__}: {error}"
        outcomes: list[str | None] = [None] * group.world_size
        dist.all_gather_object(outcomes, mine, group=group.cpu_group)
        failures = [(r, m) for r, m in enumerate(outcomes) if m is not None]
        if not failures:
            return False, None
        if group.rank_in_group != group.world_size - 1:
            return True, None
        if error is not None and len(failures) == 1:
            return True, error
        listed = "; ".join(f"TP rank {r}: {m}" for r, m in failures)
        return True, TransferError(
            f"{step} failed on {len(failures)} of {group.world_size} workers of this vLLM "
            f"server ({listed})"
        )

    def shutdown(self) -> None:
        self._abort_round()
        self.inner.shutdown()

    def _end_vllm_session(self) -> None:
        """End vLLM's worker session after a failed finish, as vLLM does after a failed update
        (else every later start is refused "already active"). vLLM gives the engine no handle
        on its worker, so this finds it among the callers."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            owner: Any = frame.f_locals.get("self")
            if (
                owner is not self
                and getattr(owner, "weight_transfer_engine", None) is self
                and isinstance(getattr(owner, "_weight_update_active", None), bool)
            ):
                owner._weight_update_active = False
                self.reset_weight_update_target()
                return
            frame = frame.f_back
        log.warning("no vLLM worker among the callers: its weight-update session stays open")

    def _abort_round(self) -> None:
        """End a receive still running, drop the staging; undo the reload on every layer not
        processed yet."""
        call, self._receiving = self._receiving, None
        if call is not None and not call.done():
            self.inner.abort()  # the engine needs a fresh init after this, as after a failure
            if not call.wait(_ABORT_WAIT_S):
                log.warning("a receive still runs %g s after its abort", _ABORT_WAIT_S)
        self._staging.drop()
        self._open = self._prepared = False
        if self._reloading:
            self._reloading = False
            abort_layerwise_reload(self.model, self.model_config)


@cache
def adapter_class(engine: str) -> type[WtcoreVLLMEngine]:
    """A :class:`WtcoreVLLMEngine` subclass bound to one wtcore engine (imports nothing more)."""
    cls_name = "Wtcore" + "".join(p.capitalize() for p in engine.replace("-", "_").split("_"))
    return type(
        cls_name + "VLLMEngine",
        (WtcoreVLLMEngine,),
        {
            "wtcore_engine": engine,
            "__doc__": f"vLLM backend {vllm_backend_name(engine)!r}: wtcore's {engine!r} engine.",
            "__module__": __name__,
        },
    )
