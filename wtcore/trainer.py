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

    Settings both ends must agree on live only here, and the trainer engine ships them to the
    workers in the init handshake, so a mismatch cannot be expressed.
    """

    backend: ClassVar[str]
    rank: int = field(kw_only=True)
    #: Delta rounds (``pip install wtcore-delta``): send only what changed since the receivers'
    #: version. ``"auto"``: only when earlier rounds say a delta round is faster.
    delta: bool | str = field(default=False, kw_only=True)
    #: Where delta keeps its copy of the base (``"cpu"`` for a model on GPU); None: with it.
    delta_base_device: str | None = field(default=None, kw_only=True)
    #: Staged rounds (docs/staged.md): every receiver stages the round beside its live weights
    #: and confirms it holds all of it before any commits; receivers must stage
    #: (``transactional=True``), others refuse the round before anything lands.
    staged: bool = field(default=False, kw_only=True)

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        """Every concrete subclass names its engine; ``abstract=True`` marks a shared base."""
        super().__init_subclass__(**kwargs)
        if not abstract and not isinstance(
            cls.__dict__.get("backend", getattr(cls, "backend", None)), str
        ):
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
        """Trainer rank 0 sends; other ranks only iterate the source in lockstep."""
        return self.rank == 0

    @property
    def rounds(self) -> str:
        """The name of this engine's round policy in :data:`wtcore.registry.ROUND_POLICIES`."""
        return "delta" if self.delta else "full"


def _receiver_times(client: object) -> list[dict[str, Any]] | None:
    """Each receiver's ``staged_s``, ``commit_s`` and ``paused_s`` of the round just finished,
    where the client can inspect its receivers and they report them; best effort."""
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
    """What a sender's rounds send; this default (``"full"``) sends the source as it is.

    :meth:`TrainerWeightTransferEngine.send_weights` runs the round (hooks, handshake, abort,
    recovery) and asks its policy, found by name (:attr:`TrainerInitInfo.rounds`), only what
    to send, so neither it nor any engine knows delta rounds (:mod:`wtcore_delta.trainer`, in
    the wtcore-delta distribution).
    """

    def __init__(self, init_info: TrainerInitInfo) -> None:
        self.init_info = init_info

    def source(
        self,
        source: WeightSource,
        client: WeightSyncClient | None,
        stats: TransferStats,
        weight_version: str | None,
    ) -> WeightSource:
        """This round's source, given the caller's, the client the round goes through and the
        version the round publishes."""
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

    :meth:`send_weights` is a template: it handles non-sender ranks (iterate in lockstep,
    touch nothing else), the hooks (started / finished / failed), the stats and recovery, and
    owns the round on the sender: it opens it, calls the engine's :meth:`_send` to move the
    bytes, and finishes it with its ``weight_version``. Engines never start or finish a round.

    Recovery: any failed round marks the engine, and the next :meth:`send_weights` runs
    :meth:`handshake` again before its round. Receivers accept ``init_weight_transfer_engine``
    mid-round and abandon the open round, so a round that failed on only some receivers cannot
    leave the healthy ones stuck in ``updating`` (the recovery contract, ``docs/protocol.md``).
    An engine takes part by implementing :meth:`worker_init_info` (or overriding
    :meth:`handshake` when it must also join a data plane).
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]
    #: Methods a concrete engine must define besides the abstract ones, each with the methods
    #: that may stand in for it. :mod:`wtcore.registry` checks them when an engine is
    #: registered or first loaded, so one written for wtcore 0.1 (which had no
    #: :meth:`worker_init_info`) is refused there, not in the middle of a recovery round.
    required_methods: ClassVar[Mapping[str, tuple[str, ...]]] = {"worker_init_info": ("handshake",)}
    #: Whether :meth:`send_weights` takes a sharded source (:mod:`wtcore.sharded`: each rank
    #: sending its own part by a plan); an engine without it refuses such a source rather than
    #: send a rank's part as if it were the whole tensor.
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
        """Rendezvous with the workers and initialize them; called on every trainer rank.

        The default builds the engine and, on the sender, runs :meth:`handshake`; if that
        fails the engine is shut down before the error propagates.
        """
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
        """Sender only: initialize every receiver (at init, and again after a failed round).

        Engines with a data plane to join (a process group) override this and call the
        client's ``init_weight_transfer_engine`` concurrently with their own rendezvous.
        """
        assert self.client is not None, "the sender always has a client"
        self.client.init_weight_transfer_engine(self.worker_init_info())

    def send_weights(
        self,
        source: WeightSource | None = None,
        *,
        weight_version: str | None = None,
        verify: bool = False,
    ) -> TransferStats:
        """Run one round (start, updates, finish); returns when every receiver has loaded.

        With ``verify=True`` every receiver's checksums are compared with digests of what was
        sent before the round is finished (see :mod:`wtcore.verify`); the client must be a
        :class:`~wtcore.client.InspectableClient`.
        """
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
            # Whatever failed, some receivers may be mid-round or hold a torn-down data plane:
            # end the round there now (so none keeps reporting consistent over what it got),
            # and start the next round with a fresh handshake (see the class docstring).
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
        """The default round driver: rank 0 sends each tensor whole and finishes the round; the
        other ranks iterate the source in lockstep (gathering a sharded tensor is a collective)."""
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
        """Sender only: :meth:`_prepare`, open the round, :meth:`_send` the round policy's
        source; again in a fresh round if the policy says so (a delta round a receiver refused
        goes again in full)."""

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
        """Sender only: open the round on every receiver (whole and sharded rounds alike), in
        the background: the engine reads its first tensors meanwhile, its first update waits."""
        assert isinstance(self.client, RoundStampingClient), "send_weights wraps the client"
        self.client.open_round()

    def _timeout_s(self) -> float:
        timeout = getattr(self.init_info, "timeout_s", None)
        return float(timeout) if isinstance(timeout, int | float) else DEFAULT_TIMEOUT_S

    def _finish_round(self, stats: TransferStats, weight_version: str | None) -> None:
        """Sender only: finish the round; every receiver publishes ``weight_version``.

        A staged round first prepares on every receiver (each confirms it holds the complete
        round), so a failure there aborts the round everywhere before any receiver commits.
        """
        assert isinstance(self.client, RoundStampingClient), "send_weights wraps the client"
        with stats.phase("control"):
            if self.init_info.staged:
                self.client.prepare()
            self.client.finish_weight_update(weight_version)

    def send_pairs(self, planned: PlannedRound, source: WeightSource, stats: TransferStats) -> None:
        """Every rank: send this rank's pairs of ``planned`` (engines with ``executes_plans``).

        Called by :func:`wtcore.sharded.round.run_sharded_round` on every trainer rank at
        once, after rank 0 has opened the round and sent the plan; rank 0 finishes it after.
        """
        raise NotImplementedError(f"{type(self).__name__} does not execute sharded plans")

    def _abort_round(self, error: BaseException) -> None:
        """Best effort, bounded by the client's timeout: end this round on every receiver.

        Only clients that can (an :class:`~wtcore.client.InspectableClient`) are asked; a
        receiver that cannot abort, or does not answer, is left to the next handshake and
        its round deadline. Never raises: the round's own error is the one that matters.
        """
        from wtcore.client import InspectableClient

        client = self.client
        if isinstance(client, RoundStampingClient):
            client.settle()  # a start still in flight must not overtake the abort
        if not isinstance(client, InspectableClient):
            return
        reason = f"the trainer's round failed: {type(error).__name__}: {error}"[:500]
        try:
            client.abort_weight_update(reason)
        except Exception as e:  # the round already failed; say why the abort did too
            # A string, not the exception: a kept log record must not keep the traceback's
            # frames (and through them this engine's data plane) alive.
            log.warning("abort_weight_update after a failed round failed too: %s", str(e))

    def _prepare(self, source: WeightSource, stats: TransferStats) -> None:  # noqa: B027
        """Sender only, before the round opens: what must happen between rounds (the kit sizes
        its staging here, which may re-run the handshake). Does nothing by default."""

    @abstractmethod
    def _send(self, source: WeightSource, stats: TransferStats) -> None:
        """Sender only: move ``source``'s bytes in the open round (``update_weights`` through
        ``self.client``); fill ``stats``. The template opens and finishes the round."""

    def shutdown(self) -> None:
        """Release the data plane. Idempotent."""
        self._closed = True

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
