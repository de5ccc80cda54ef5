"""The receiver half of delta rounds: :class:`DeltaSink`, first in every worker's sink chain.

A round whose first tensor is the header is a delta round; it is refused
(:class:`StaleBaseError`) unless this receiver holds the header's base, consistent, from the same
trainer lineage, and every patch is checked before any of its batch is written. Full rounds pass
through. See docs/architecture.md, "Delta rounds".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from wtcore.errors import PayloadError, ProtocolStateError
from wtcore.meta import ParamMeta, dtype_name
from wtcore.sink import ReadableSink, WeightSink
from wtcore_delta.codec import apply_patch, decode
from wtcore_delta.header import HEADER_NAME, DeltaHeader

if TYPE_CHECKING:
    import torch

    from wtcore_delta.codec import Decoded

__all__ = ["DeltaSink", "StaleBaseError", "delta_sink_for", "sink_accepts_patches"]


class StaleBaseError(ProtocolStateError):
    """A delta round's base is not what this receiver holds (HTTP 409, nothing applied).

    The trainer recognizes the name in a receiver's failure, over every transport, and answers
    with a full round.
    """


def sink_accepts_patches(sink: object) -> bool:
    """Whether patches can be applied to ``sink``: it says so, or it can show its tensors."""
    declared = getattr(sink, "accepts_patches", None)
    if isinstance(declared, bool):
        return declared
    return isinstance(sink, ReadableSink)


class DeltaSink:
    """Decodes delta rounds into ``chain`` (the rest of the worker's sink chain).

    ``readable`` shows the tensors a patch applies to (the staging view when transactional);
    ``in_place`` maps names to the live tensors that may be patched directly, or is ``None``.
    """

    def __init__(
        self,
        chain: WeightSink,
        *,
        readable: ReadableSink | None,
        in_place: Mapping[str, torch.Tensor] | None,
        accepts: bool,
    ) -> None:
        self.chain = chain
        self.readable = readable
        self.in_place = in_place
        self.accepts = accepts and (readable is not None or in_place is not None)
        self._base: str | None = None
        #: The lineage the last finished round left (None: unknown), and the open round's.
        self._held: str | None = None
        self._lineage: str | None = None
        self._items: dict[str, str] | None = None
        self._specs: dict[str, tuple[str, list[int]]] = {}
        self._seen: set[str] = set()
        #: Whether the open round's kind is still unknown (no batch, no telling announcement).
        self._first = True
        #: Whether the open round's first announcement came (only that one decides, see plan).
        self._planned = False
        self.applied = False

    @classmethod
    def for_chain(
        cls, chain: WeightSink, sink: WeightSink, staging: ReadableSink | None
    ) -> DeltaSink:
        """The layer the worker builds (:class:`wtcore.worker.ReceiverLayer`)."""
        return delta_sink_for(chain, sink, staging)

    def begin(self, version: str | None, consistent: bool) -> None:
        self._base = version if consistent else None
        self._lineage = None
        self._items, self._seen, self._first, self.applied = None, set(), True, False
        self._planned = False

    @property
    def delta_round(self) -> bool:
        return self._items is not None

    def plan(self, metas: object) -> None:
        """One update's announced tensors, before any lands. A round whose first announced
        tensor is not the header is full, so destinations are offered from its first tensor
        on (received in place, not staged and copied)."""
        first = metas[0] if isinstance(metas, Sequence) and metas else None
        if self._first and not self._planned and isinstance(first, ParamMeta):
            self._planned = True
            self._first = first.name == HEADER_NAME  # else known full: a header is refused

    def destination(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The chain's in-place destination, only once the round is known to be full (a patch
        must be decoded, never received in place)."""
        if self._first or self._items is not None or name == HEADER_NAME:
            return None
        offer = getattr(self.chain, "destination", None)
        t = offer(name, dtype, shape) if callable(offer) else None
        if t is not None:
            self.applied = True  # the engine writes into the chain's tensor
        return t  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        if not batch:
            return
        if self._first:
            self._first = False
            if batch[0][0] == HEADER_NAME:
                self._items = self._open(DeltaHeader.from_tensor(batch[0][1]))
                batch = batch[1:]
                if not batch:
                    return
        for name, _ in batch:
            if name == HEADER_NAME:
                raise PayloadError(
                    f"{HEADER_NAME!r} may only be the first tensor of a round; nothing of this "
                    "batch was applied"
                )
        if self._items is None:
            self.applied = True
            self.chain.load_weights(batch)
            return
        self._load_delta(batch, self._items)

    def _open(self, header: DeltaHeader) -> dict[str, str] | None:
        if header.marks_full:
            self._lineage = header.lineage
            return None
        if not self.accepts:
            raise StaleBaseError(
                "delta round refused: this receiver's sink cannot apply patches (it reports "
                "delta: false); send a full round"
            )
        if self._base is None or header.base != self._base:
            holds = "no consistent version" if self._base is None else f"{self._base!r}"
            raise StaleBaseError(
                f"delta round refused: its patches apply to version {header.base!r}, this "
                f"receiver holds {holds}; nothing was applied, send a full round"
            )
        if self._held != header.lineage:
            raise StaleBaseError(
                f"delta round refused: this receiver's {header.base!r} is not the sending "
                "trainer's (another trainer, or this one before a restart, published weights "
                "under that version name); nothing was applied, send a full round"
            )
        self._lineage = header.lineage
        self._specs = header.specs
        return header.items

    def _load_delta(self, batch: list[tuple[str, torch.Tensor]], items: dict[str, str]) -> None:
        whole: list[tuple[str, torch.Tensor]] = []
        blobs: list[tuple[str, torch.Tensor]] = []
        names: set[str] = set()
        for name, t in batch:
            kind = items.get(name)
            if kind is None:
                raise PayloadError(
                    f"delta round: {name!r} is not listed in the round's header; nothing of "
                    "this batch was applied"
                )
            if name in self._seen or name in names:
                raise PayloadError(f"delta round: {name!r} arrived twice; nothing applied")
            names.add(name)
            (blobs if kind == "patch" else whole).append((name, t))
        # Check every patch against its current tensor before writing anything of the batch.
        targets = self._targets() if blobs else {}
        decoded: list[tuple[str, Decoded]] = []
        for name, blob in blobs:
            target = targets.get(name)
            if target is None:
                raise PayloadError(
                    f"delta patch for {name!r}: the sink holds no tensor of that name; nothing "
                    "of this batch was applied"
                )
            want = self._specs[name]
            held = (dtype_name(target.dtype), list(target.shape))
            if held != want:
                raise PayloadError(
                    f"delta patch for {name!r}: computed for {want[0]} {want[1]}, the sink holds "
                    f"{held[0]} {held[1]}; nothing of this batch was applied"
                )
            decoded.append((name, decode(blob, target, name=name)))
        self._seen |= names
        self.applied = True
        if whole:
            self.chain.load_weights(whole)
        if not decoded:
            return
        import torch

        with torch.no_grad():
            if self.in_place is not None:
                for name, patch in decoded:
                    live = targets[name].detach()
                    if live.is_contiguous():
                        apply_patch(live, patch)
                    else:
                        new = live.contiguous()
                        apply_patch(new, patch)
                        live.copy_(new)
                return
            patched: list[tuple[str, torch.Tensor]] = []
            for name, patch in decoded:
                new = targets[name].detach().clone(memory_format=torch.contiguous_format)
                apply_patch(new, patch)
                patched.append((name, new))
            self.chain.load_weights(patched)

    def _targets(self) -> Mapping[str, torch.Tensor]:
        if self.in_place is not None:
            return self.in_place
        assert self.readable is not None, "accepts is False without a readable sink"
        return dict(self.readable.named_tensors())

    def finish(self) -> None:
        """Every tensor the header listed must have arrived; the weights take its lineage."""
        if self._items is None:
            self._held = self._lineage
            return
        missing = [n for n in self._items if n not in self._seen]
        if missing:
            shown = ", ".join(map(repr, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise PayloadError(
                f"delta round incomplete: {len(missing)} tensor(s) listed in its header never "
                f"arrived ({shown}); the round is not published"
            )
        self._held = self._lineage


def delta_sink_for(chain: WeightSink, sink: WeightSink, staging: ReadableSink | None) -> DeltaSink:
    """The :class:`DeltaSink` in front of ``chain`` (ending in ``sink``): patches in place only
    when ``chain`` is the sink itself and offers ``patch_targets()``."""
    accepts = sink_accepts_patches(sink)
    targets = getattr(sink, "patch_targets", None)
    in_place = targets() if chain is sink and callable(targets) else None
    readable: ReadableSink | None = staging
    if readable is None and isinstance(sink, ReadableSink):
        readable = sink
    return DeltaSink(chain, readable=readable, in_place=in_place, accepts=accepts)
