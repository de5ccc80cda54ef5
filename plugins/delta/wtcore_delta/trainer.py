"""The trainer half of delta rounds: the base, the per-tensor choice, and the round policy.

:class:`DeltaTracker` keeps the base (a copy of what every receiver holds) and encodes rounds
against it; :class:`DeltaRounds` is the ``delta`` round policy. The base is kept only if a round
completes everywhere, and a refused delta round is resent full from the base, so the source is
iterated once per call. See docs/architecture.md, "Delta rounds".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from wtcore.errors import ReceiverError, WtcoreError
from wtcore.meta import ParamMeta, dtype_name
from wtcore.source import TensorSource, WeightSource, iter_checked
from wtcore.trainer import RoundPolicy, TrainerInitInfo
from wtcore_delta.auto import AutoDelta
from wtcore_delta.codec import bits, plan
from wtcore_delta.header import HEADER_NAME, DeltaHeader, new_lineage

if TYPE_CHECKING:
    import numpy as np
    import torch

    from wtcore.client import WeightSyncClient
    from wtcore.stats import TransferStats

__all__ = ["DeltaReport", "DeltaRounds", "DeltaTracker"]

log = logging.getLogger("wtcore.delta")

#: Tensors with more elements than this are sampled before the exact comparison.
SAMPLE_ABOVE = 1 << 14
SAMPLE_SIZE = 2048
#: The most rounds a dense tensor is sent whole without refreshing its base (the waits grow
#: 0, 1, 3, 7, ... while it stays dense, so an always-dense model rarely pays a base copy).
MAX_DENSE_WAIT = 15


@dataclass
class DeltaReport:
    """What one round did (``TransferStats.delta``)."""

    mode: str = "full"
    why: str = ""
    model_bytes: int = 0
    elements: int = 0
    changed: int = 0
    tensors: dict[str, int] = field(default_factory=lambda: {"same": 0, "patch": 0, "full": 0})
    #: Tensors whose base was copied whole this round (new, reshaped, refreshed).
    base_copies: int = 0
    #: What delta added to the round, in seconds.
    check_seconds: float = 0.0
    encode_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        elements, changed = out.pop("elements"), out.pop("changed")
        return {**out, "changed_fraction": changed / elements if elements else 0.0}


def _dense_by_sample(new: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether a sample says that no patch could be smaller than the whole tensor."""
    nb, bb = bits(new), bits(base)
    n = nb.numel()
    if n <= SAMPLE_ABOVE:
        return False
    step = n // SAMPLE_SIZE
    s_new = nb[::step][:SAMPLE_SIZE].cpu().numpy()
    s_base = bb[::step][:SAMPLE_SIZE].cpu().numpy()
    changed = float((s_new != s_base).mean())
    # A mask patch costs n/8 bytes plus the changed values: it loses from this density up.
    return changed >= 1.0 - 1.0 / (8 * nb.element_size())


#: From this share of changed elements up, a streaming copy of the base beats a scatter.
COPY_BASE_ABOVE = 1 / 64


def _update_base(base: torch.Tensor, new: torch.Tensor, idx: torch.Tensor) -> None:
    if idx.numel() > base.numel() * COPY_BASE_ABOVE:
        base.copy_(new)
    elif base.device.type == "cpu" and new.device.type == "cpu":
        i = idx.numpy()
        base.numpy()[i] = new.numpy()[i]
    else:
        base[idx.to(base.device)] = new[idx].to(base.device)


class DeltaTracker:
    """The base and its version; ``base_device`` keeps it elsewhere (``"cpu"``)."""

    def __init__(self, base_device: str | None = None) -> None:
        self.base_device = base_device
        self.version: str | None = None
        self.lineage = new_lineage()
        #: Whether every receiver reports ``delta: true``, so a full round may name its lineage
        #: (a receiver without the delta layer would load the header as a tensor).
        self.marks = False
        #: name -> base tensor, or None when it was dropped (sent whole, not copied).
        self._base: dict[str, torch.Tensor | None] = {}
        self._order: list[str] = []
        self._kept: dict[str, torch.Tensor] = {}
        #: name -> (rounds found dense in a row, rounds left before its base is refreshed).
        self._dense: dict[str, tuple[int, int]] = {}
        #: name -> (finish, base, new) of each patch whose values are gathered as it is sent.
        self._pending: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor]]
        self._pending = {}
        #: The comparison's bool array, reused: sized to the largest tensor compared.
        self._scratch: np.ndarray[Any, Any] | None = None
        #: Seconds spent copying into the base (``delta="auto"`` measures the link without them).
        self.copy_seconds = 0.0

    def _scratch_for(self, numel: int) -> np.ndarray[Any, Any]:
        import numpy as np

        if self._scratch is None or self._scratch.size < numel:
            self._scratch = np.empty(numel, dtype=np.bool_)
        return self._scratch

    def invalidate(self) -> None:
        self.version, self._base, self._order, self._kept, self._dense = None, {}, [], {}, {}
        self._scratch, self._pending = None, {}

    def commit(self, version: str | None) -> None:
        """The round completed on every receiver: its weights are the base of the next."""
        for name in list(self._pending):  # an engine that skipped a tensor: keep the base true
            self._finish(name)
        self.version = version
        self._kept = {}
        if version is None:
            self.invalidate()

    def why_full(self, client: object) -> str | None:
        """Why this round must be full, or ``None`` when every receiver holds the base."""
        from wtcore.client import inspectable

        self.marks = False
        inspecting = inspectable(client)
        if inspecting is None:
            return "the client cannot report the receivers' versions (weight_info)"
        try:
            infos = inspecting.weight_info()
        except WtcoreError as e:
            return f"weight_info failed ({type(e).__name__})"
        self.marks = all(info.get("delta") is True for info in infos)
        if self.version is None:
            return "no base yet (first round, a failed round, or no weight_version)"
        for i, info in enumerate(infos):
            if info.get("delta") is not True:
                return f"receiver {i} does not take patches"
            if info.get("weight_version") != self.version or info.get("consistent") is not True:
                return (
                    f"receiver {i} holds {info.get('weight_version')!r} "
                    f"(consistent: {info.get('consistent')}), the base is {self.version!r}"
                )
        return None

    def _store(self, name: str, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        old = self._base.get(name)
        if old is not None and old.dtype == t.dtype and old.shape == t.shape:
            old.copy_(t)
        else:
            self._base[name] = t.detach().to(device=self.base_device or t.device, copy=True)
        self.copy_seconds += time.perf_counter() - t0

    def refreshing(self, source: WeightSource) -> WeightSource:
        """A full round's source that copies every tensor into the base as it is sent."""
        return _Refreshing(self, source, self.mark() if self.marks else None)

    def mark(self) -> tuple[str, torch.Tensor]:
        return HEADER_NAME, DeltaHeader(None, {}, lineage=self.lineage).to_tensor()

    def encode(self, source: WeightSource, report: DeltaReport) -> WeightSource:
        """Iterate ``source`` once: the delta round's source; the base becomes the new weights."""
        assert self.version is not None, "encode needs a base (why_full said so)"
        items: dict[str, str] = {}
        specs: dict[str, tuple[str, list[int]]] = {}
        out: list[tuple[str, torch.Tensor]] = []
        kept: dict[str, torch.Tensor] = {}  # tensors sent whole without a base copy
        names = []
        for meta, t in iter_checked(source):
            names.append(meta.name)
            report.elements += t.numel()
            report.model_bytes += meta.nbytes
            base = self._base.get(meta.name)
            streak, wait = self._dense.get(meta.name, (0, 0))
            if base is None and meta.name in self._base and wait > 0:
                kind = "full"  # dense lately: whole again, base still not copied
                self._dense[meta.name] = (streak, wait - 1)
                kept[meta.name] = t
                report.changed += t.numel()
            elif base is None or base.dtype != t.dtype or base.shape != t.shape:
                kind = "full"  # new, dropped, or reshaped: whole, and the base is refreshed
                self._store(meta.name, t)
                report.changed += t.numel()
                report.base_copies += 1
            elif _dense_by_sample(t, base):
                kind = "full"
                self._base[meta.name] = None
                self._dense[meta.name] = (streak + 1, min(2**streak - 1, MAX_DENSE_WAIT))
                kept[meta.name] = t
                report.changed += t.numel()
            else:
                self._dense.pop(meta.name, None)
                cmp_base = base if base.device == t.device else base.to(t.device)
                scratch = self._scratch_for(t.numel()) if t.device.type == "cpu" else None
                enc, finish = plan(t, cmp_base, scratch=scratch)
                report.changed += enc.count
                kind = enc.kind
                if enc.kind == "patch":
                    assert enc.blob is not None and finish is not None
                    self._pending[meta.name] = (finish, base, t)
                    out.append((meta.name, enc.blob))
                    specs[meta.name] = (dtype_name(meta.dtype), list(meta.shape))
                elif enc.kind == "full":
                    base.copy_(t)
            report.tensors[kind] += 1
            if kind == "full":
                out.append((meta.name, t))
            if kind != "same":
                items[meta.name] = kind
        for gone in set(self._base) - set(names):
            del self._base[gone]
            self._dense.pop(gone, None)
        self._order, self._kept = names, kept
        header = DeltaHeader(self.version, items, specs, self.lineage).to_tensor()
        return _Finishing(self, [(HEADER_NAME, header), *out])

    def _finish(self, name: str) -> None:
        pending = self._pending.pop(name, None)
        if pending is not None:
            finish, base, new = pending
            _update_base(bits(base), bits(new), finish())

    def base_source(self) -> WeightSource:
        """The weights just encoded, whole (the base, plus tensors kept without a copy)."""
        for name in list(self._pending):  # patches the refused round did not reach
            self._finish(name)
        items = [self.mark()] if self.marks else []
        for name in self._order:
            t = self._base.get(name)
            items.append((name, t if t is not None else self._kept[name]))
        return TensorSource(items)


class _Finishing(TensorSource):
    """The delta round's source: each patch is gathered as the engine reaches it, overlapping
    earlier buckets on the wire."""

    def __init__(self, tracker: DeltaTracker, items: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__(items)
        self.tracker = tracker

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in super().__iter__():
            self.tracker._finish(name)
            yield name, t


class _Refreshing(WeightSource):
    def __init__(
        self,
        tracker: DeltaTracker,
        inner: WeightSource,
        mark: tuple[str, torch.Tensor] | None,
    ) -> None:
        self.tracker, self.inner, self.mark = tracker, inner, mark

    def metadata(self) -> list[ParamMeta]:
        metas = self.inner.metadata()
        return metas if self.mark is None else [ParamMeta.of(*self.mark), *metas]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tracker, names = self.tracker, []
        tracker._kept = {}
        if self.mark is not None:
            yield self.mark
        for name, t in self.inner:
            tracker._store(name, t)
            names.append(name)
            yield name, t
        for gone in set(tracker._base) - set(names):
            del tracker._base[gone]
        tracker._order = names


def _refused(error: BaseException) -> bool:
    """Whether any receiver refused the round's base: with a broadcast engine the others then
    fail too, and the full round that follows is the remedy for all of them."""
    # Ray names a remote error's type "RayTaskError(StaleBaseError)": match the name inside.
    return isinstance(error, ReceiverError) and any(
        "StaleBaseError" in (f.error_type or "") for f in error.failures
    )


class DeltaRounds(RoundPolicy):
    """The ``"delta"`` round policy (``delta=True``): a delta round when it can, else full."""

    def __init__(self, init_info: TrainerInitInfo) -> None:
        super().__init__(init_info)
        self.tracker = DeltaTracker(init_info.delta_base_device)
        self._report = DeltaReport()
        self._keeps_base = False
        self._started = 0.0
        self.auto = AutoDelta() if init_info.delta == "auto" else None

    def source(
        self,
        source: WeightSource,
        client: WeightSyncClient | None,
        stats: TransferStats,
        weight_version: str | None,
    ) -> WeightSource:
        tracker, report = self.tracker, DeltaReport()
        self._report, self._keeps_base = report, False
        self._started = time.perf_counter()  # the round's time, for auto (stats has it later)
        tracker.copy_seconds = 0.0
        if weight_version is None:
            # Without a version no receiver can name its base: a plain full round, no base copy.
            tracker.invalidate()
            report.why = "no weight_version: a base is recognized by its version"
            report.model_bytes = sum(m.nbytes for m in source.metadata())
            return source
        auto = self.auto
        if auto is not None:
            mode, report.why = auto.choose()
            if mode == "full" and not auto.refresh_base():
                tracker.invalidate()  # no base kept: a copy of the model saved
                report.model_bytes = sum(m.nbytes for m in source.metadata())
                return source
        self._keeps_base = True  # from here on the round's weights become the base
        t0 = time.perf_counter()
        with stats.phase("control"):
            why = tracker.why_full(client)
        report.check_seconds = time.perf_counter() - t0
        if auto is not None and mode == "full" and why is None:
            why = report.why  # a full round that keeps the base for a delta round to come
        if why is not None:
            report.why = why if auto is None or why == report.why else f"{report.why}; {why}"
            metas = source.metadata()
            report.model_bytes = sum(m.nbytes for m in metas)
            report.base_copies = len(metas)
            return tracker.refreshing(source)
        t0 = time.perf_counter()
        with stats.phase("pack"):
            sent = tracker.encode(source, report)
        report.encode_seconds = time.perf_counter() - t0
        report.mode = "delta"  # unless refused (resend)
        return sent

    def resend(self, error: BaseException) -> WeightSource | None:
        """A receiver changed since ``weight_info``: a full round, from the base."""
        if self._report.mode != "delta" or not _refused(error):
            return None
        log.warning("delta round refused by receivers; sending a full round instead: %s", error)
        self._report.mode, self._report.why = "full", "refused by receivers (StaleBaseError)"
        return self.tracker.base_source()

    def committed(self, stats: TransferStats, weight_version: str | None) -> None:
        report = self._report
        stats.delta = report.to_dict()
        if self.auto is not None and weight_version is not None:
            added = report.check_seconds + report.encode_seconds
            seconds = time.perf_counter() - self._started - self.tracker.copy_seconds
            self.auto.measured(report.mode, report.model_bytes, seconds, added)
        self.tracker.commit(weight_version if self._keeps_base else None)

    def aborted(self) -> None:
        self.tracker.invalidate()  # the receivers may hold anything: the next round is full
