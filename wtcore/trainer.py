"""The trainer half of a weight-transfer engine."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import PayloadError, ProtocolStateError
from wtcore.registry import ROUND_POLICIES
from wtcore.rounds import RoundStampingClient
from wtcore.source import WeightSource, iter_checked
from wtcore.stats import ROUND_TIMES, TransferStats

if TYPE_CHECKING:
    from wtcore.client import WeightSyncClient
    from wtcore.sharded.plan import PlannedRound

__all__ = ["RoundPolicy", "TrainerInitInfo", "TrainerWeightTransferEngine"]

log = logging.getLogger("wtcore.trainer")

E = TypeVar("E", bound="TrainerWeightTransferEngine")


@dataclass
class TrainerInitInfo:
    """Trainer-side settings of one engine; subclasses set ``backend`` to the registry name.
    Settings both ends must agree on live only here (shipped at init), so they cannot differ."""

    backend: ClassVar[str]
    rank: int = field(kw_only=True)
    #: Delta rounds (``pip install wtcore-delta``): send only what changed since the receivers'
    #: version. ``"auto"``: only when earlier rounds say a delta round is faster.
    delta: bool | str = field(default=False, kw_only=True)
    #: Where delta keeps its copy of the base (``"cpu"`` for a model on GPU); None: with it.
    delta_base_device: str | None = field(default=None, kw_only=True)
    #: Staged rounds (docs/staged.md): no receiver commits before all hold the whole round.
    staged: bool = field(default=False, kw_only=True)

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not abstract and not isinstance(getattr(cls, "backend", None), str):
            raise PayloadError(
                f"{cls.__name__} must set the class attribute `backend` to the name of its "
                "engine in the wtcore.backends registry"
            )

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise PayloadError(f"rank: expected a non-negative int, got {self.rank!r}")
        if not isinstance(self.staged, bool):
            raise PayloadError(f"staged: expected a bool, got {self.staged!r}")
        if not isinstance(self.delta, bool) and self.delta != "auto":
            raise PayloadError(f"delta: expected a bool or 'auto', got {self.delta!r}")
        if self.delta_base_device is not None and not isinstance(self.delta_base_device, str):
            got = self.delta_base_device
            raise PayloadError(f"delta_base_device: expected a device string or None, got {got!r}")

    @property
    def is_sender(self) -> bool:
        """Trainer rank 0 sends; other ranks only iterate the source."""
        return self.rank == 0

    @property
    def rounds(self) -> str:
        """This engine's round policy in :data:`wtcore.registry.ROUND_POLICIES`."""
        return "delta" if self.delta else "full"


def _receiver_times(client: object) -> list[dict[str, Any]] | None:
    """Each receiver's :data:`ROUND_TIMES` of the round just finished; best effort."""
    from wtcore.client import InspectableClient

    if not isinstance(client, InspectableClient):
        return None
    try:
        infos = client.weight_info()
    except Exception as e:  # the round is published; its times are only a report
        log.warning("weight_info after the round failed: %s", str(e))
        return None
    return [{k: info.get(k) for k in ROUND_TIMES} for info in infos]


class RoundPolicy:
    """What a sender's rounds send (so no engine knows delta rounds); this default (``"full"``)
    sends the source as it is."""

    def __init__(self, init_info: TrainerInitInfo) -> None:
        self.init_info = init_info

    def source(
        self,
        source: WeightSource,
        client: WeightSyncClient | None,
        stats: TransferStats,
        weight_version: str | None,
    ) -> WeightSource:
        """This round's source, given the caller's."""
        return source

    def resend(self, error: BaseException) -> WeightSource | None:
        """After the engine failed: what to send instead (after an abort and a handshake)."""
        return None

    def committed(self, stats: TransferStats, weight_version: str | None) -> None:
        """Every receiver loaded the round and published ``weight_version``."""

    def aborted(self) -> None:
        """The round failed: the receivers may hold anything."""


class TrainerWeightTransferEngine(ABC):
    """Sends a :class:`WeightSource` to every receiver reachable through a client.

    :meth:`send_weights` owns the round (start, finish, hooks, stats, recovery: a failed round
    makes the next re-run :meth:`handshake`); an engine only moves the bytes in :meth:`_send`.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]
    #: Methods a concrete engine must define besides the abstract ones (each with its stand-ins),
    #: checked at registration, so a 0.1 engine is refused there, not mid-recovery.
    required_methods: ClassVar[Mapping[str, tuple[str, ...]]] = {"worker_init_info": ("handshake",)}
    #: Whether the engine executes sharded plans (:meth:`send_pairs`); one that does not
    #: refuses a sharded source rather than send a rank's part as the whole tensor.
    executes_plans: ClassVar[bool] = False

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None,
    ) -> None:
        info_cls = getattr(self, "init_info_cls", TrainerInitInfo)
        if not isinstance(init_info, info_cls):
            raise PayloadError(
                f"trainer engine {init_info.backend!r} ({type(self).__name__}) expects "
                f"{info_cls.__name__}, got {type(init_info).__name__}"
            )
        if init_info.is_sender and client is None:
            raise PayloadError("trainer_init: the sender (rank 0) needs a client")
        self.init_info = init_info
        self.client = client
        self.source = source
        self._closed = False
        #: Set by a failed round: the next :meth:`send_weights` re-runs :meth:`handshake`.
        self.needs_handshake = False
        self.rounds: RoundPolicy = ROUND_POLICIES.load(init_info.rounds)(init_info)

    @classmethod
    def host_status(cls) -> str:
        """One line saying whether and how this engine can run here (``wtcore plugins``)."""
        return "available"

    @classmethod
    def trainer_init(
        cls: type[E],
        init_info: TrainerInitInfo,
        *,
        client: WeightSyncClient | None,
        source: WeightSource | None = None,
    ) -> E:
        """Build the engine on every trainer rank; the sender runs :meth:`handshake`."""
        engine = cls(init_info, client=client, source=source)
        if init_info.is_sender:
            try:
                engine.handshake()
            except BaseException:
                engine.shutdown()
                raise
        return engine

    def worker_init_info(self) -> dict[str, Any]:
        """The JSON ``init_info`` every receiver gets in ``init_weight_transfer_engine``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement worker_init_info() (or override "
            "handshake()) so that it can initialize receivers and recover after a failed round"
        )

    def handshake(self) -> None:
        """Sender only: initialize every receiver (at init, and after a failed round). An engine
        with a data plane to join overrides it, to rendezvous concurrently with the call."""
        assert self.client is not None, "the sender always has a client"
        self.client.init_weight_transfer_engine(self.worker_init_info())

    def send_weights(
        self,
        source: WeightSource | None = None,
        *,
        weight_version: str | None = None,
        verify: bool = False,
    ) -> TransferStats:
        """Run one round; returns when every receiver has loaded it. ``verify=True`` compares
        receivers' checksums with what was sent before the finish (:mod:`wtcore.verify`)."""
        from wtcore.hooks import notify

        if self._closed:
            raise ProtocolStateError(f"send_weights: {type(self).__name__} was shut down")
        src = source if source is not None else self.source
        if src is None:
            raise PayloadError("send_weights: no source given here or at trainer_init")
        # The source picks how its round runs (refusing first what it cannot do): whole or sharded.
        drive = src.round_driver(self, verify) or self._whole_round
        stats = TransferStats(backend=self.init_info.backend)
        t0 = time.perf_counter()
        if not self.init_info.is_sender:
            drive(src, stats, weight_version)
            stats.seconds = time.perf_counter() - t0
            return stats
        if not src.metadata():
            # Receivers refuse to publish a round that changed nothing (docs/protocol.md).
            raise PayloadError("send_weights: the source has no tensors; nothing to send")
        notify("wtcore_update_started", engine=self, weight_version=weight_version)
        client = self.client
        try:
            if verify:
                from wtcore.verify import DigestingSource, VerifyingClient

                assert client is not None, "the sender always has a client"
                src = DigestingSource(src)
                self.client = VerifyingClient(client, src)
            # the owner's id in every update
            self.client = RoundStampingClient(
                self.client, self._timeout_s() + 30, staged=self.init_info.staged
            )
            if self.needs_handshake:
                with stats.phase("control"):
                    self.handshake()
                self.needs_handshake = False
            drive(src, stats, weight_version)
            self.rounds.committed(stats, weight_version)
            if verify:
                stats.bytes_landed = getattr(self.client, "landed", None)
        except BaseException as e:
            self.rounds.aborted()
            # Receivers may be mid-round or hold a torn-down data plane: end the round there
            # now, and start the next one with a fresh handshake.
            self.needs_handshake = True
            self._abort_round(e)
            notify("wtcore_update_failed", engine=self, weight_version=weight_version, error=e)
            raise
        finally:
            self.client = client
        stats.seconds = time.perf_counter() - t0
        stats.receiver_times = _receiver_times(client)
        notify("wtcore_update_finished", engine=self, stats=stats, weight_version=weight_version)
        return stats

    def _whole_round(
        self, source: WeightSource, stats: TransferStats, weight_version: str | None
    ) -> None:
        """The default round driver: rank 0 sends each tensor whole; other ranks iterate the
        source in lockstep (gathering a sharded tensor is a collective)."""
        if not self.init_info.is_sender:
            with stats.phase("materialize"):
                for meta, _ in iter_checked(source):
                    stats.num_tensors += 1
                    stats.num_bytes += meta.nbytes
            return
        self._send_round(source, stats, weight_version)
        self._finish_round(stats, weight_version)

    def _send_round(
        self, source: WeightSource, stats: TransferStats, weight_version: str | None
    ) -> None:
        """Sender only: prepare, open and send the policy's source; again in a fresh round if
        the policy says so (a refused delta round goes again in full)."""

        def move(src: WeightSource) -> None:
            self._prepare(src, stats)
            self._start_round(stats)
            self._send(src, stats)

        try:
            move(self.rounds.source(source, self.client, stats, weight_version))
        except BaseException as e:
            again = self.rounds.resend(e)
            if again is None:
                raise
            self._abort_round(e)
            with stats.phase("control"):
                self.handshake()
            move(again)

    def _start_round(self, stats: TransferStats) -> None:
        """Sender only: open the round in the background; the first update waits for it."""
        assert isinstance(self.client, RoundStampingClient), "send_weights wraps the client"
        self.client.open_round()

    def _timeout_s(self) -> float:
        timeout = getattr(self.init_info, "timeout_s", None)
        return float(timeout) if isinstance(timeout, int | float) else DEFAULT_TIMEOUT_S

    def _finish_round(self, stats: TransferStats, weight_version: str | None) -> None:
        """Sender only: finish the round (a staged one prepares everywhere first, so no
        receiver commits unless all hold the complete round)."""
        assert isinstance(self.client, RoundStampingClient), "send_weights wraps the client"
        with stats.phase("control"):
            if self.init_info.staged:
                self.client.prepare()
            self.client.finish_weight_update(weight_version)

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Every rank: send this rank's pairs of ``planned`` (engines with ``executes_plans``),
        after rank 0 opened the round and sent the plan."""
        raise NotImplementedError(f"{type(self).__name__} does not execute sharded plans")

    def _abort_round(self, error: BaseException) -> None:
        """Best effort: end this round on every receiver an inspectable client reaches. Never
        raises: the round's own error is the one that matters."""
        from wtcore.client import inspectable

        if isinstance(self.client, RoundStampingClient):
            self.client.settle()  # a start still in flight must not overtake the abort
        client = inspectable(self.client)
        if client is None:
            return
        reason = f"the trainer's round failed: {type(error).__name__}: {error}"[:500]
        try:
            client.abort_weight_update(reason)
        except Exception as e:  # the round already failed; say why the abort did too
            # A string: a kept log record must not keep the traceback's frames alive.
            log.warning("abort_weight_update after a failed round failed too: %s", str(e))

    def _prepare(self, source: WeightSource, stats: TransferStats) -> None:  # noqa: B027
        """Sender only, before the round opens (the kit sizes its staging here)."""

    @abstractmethod
    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        """Sender only: move ``source``'s bytes in the open round (``update_weights`` through
        ``self.client``); fill ``stats``."""

    def shutdown(self) -> None:
        """Release the data plane. Idempotent."""
        self._closed = True

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
