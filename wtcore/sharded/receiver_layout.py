"""What a receiver reports about how it is sharded, and the receivers' layouts a trainer plans to.

Why a receiver reports rules and not boxes: a receiver knows how its model is split (vLLM's
``ColumnParallelLinear`` splits output features, ``RowParallelLinear`` input features,
``VocabParallelEmbedding`` the vocabulary, the rest is replicated), but not always the global
shapes, which are the trainer's. So it reports its TP rank and size and one rule per group of
names (:class:`TPLayout`, a few hundred bytes whatever the model's size), and the trainer turns
them into boxes with the global shapes it already has (:func:`receiver_layouts`). A receiver
that reports nothing holds whole replicas, today's case. ``absent`` names what a receiver does
not hold at all (the experts an expert-parallel placement puts elsewhere): it gets none of it.

The report reaches the trainer through ``weight_info()`` (key ``"layout"``) on every client,
so it is checked like anything else a peer sends: :meth:`TPLayout.from_wire` refuses a bad
field by name, and a receiver whose rules do not fit a tensor is refused before any plan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.sharded.layout import MAX_RANKS, Box, Layout, is_int, region, tp_box

if TYPE_CHECKING:
    import torch

    from wtcore.meta import ParamMeta

__all__ = ["KINDS", "MAX_RULES", "TPLayout", "receiver_layouts"]

#: The layouts a rule may name (:func:`wtcore.sharded.layout.tp_box`; ``absent``: none of it).
KINDS = ("column", "row", "vocab", "replicated", "absent")
#: The most rules one receiver may report, and the longest pattern.
MAX_RULES = 1024
MAX_PATTERN = 256


@dataclass(frozen=True)
class TPLayout:
    """Receiver ``tp_rank`` of a TP group of ``tp_size``; ``rules`` map names to layouts.

    ``rules`` is a sequence of ``(pattern, kind)``: a shell-style pattern (``fnmatch``, case
    sensitive) over parameter names, and one of :data:`KINDS`. The first matching rule wins;
    a name no rule matches is ``default`` (replicated unless said otherwise).
    """

    tp_rank: int
    tp_size: int
    rules: tuple[tuple[str, str], ...] = ()
    default: str = "replicated"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(tuple(r) for r in self.rules))
        self._check("layout")

    def _check(self, field: str) -> None:
        if not is_int(self.tp_size) or not 0 < self.tp_size <= MAX_RANKS:
            raise PayloadError(f"{field}.tp_size: expected 1 to {MAX_RANKS}, got {self.tp_size!r}")
        if not is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise PayloadError(
                f"{field}.tp_rank: expected 0 to {self.tp_size - 1}, got {self.tp_rank!r}"
            )
        if self.default not in KINDS:
            got = self.default
            raise PayloadError(f"{field}.default: expected one of {KINDS}, got {got!r:.40}")
        if len(self.rules) > MAX_RULES:
            raise PayloadError(f"{field}.rules: more than {MAX_RULES} rules")
        for i, rule in enumerate(self.rules):
            ok = len(rule) == 2 and isinstance(rule[0], str) and 0 < len(rule[0]) <= MAX_PATTERN
            if not ok:
                raise PayloadError(
                    f"{field}.rules[{i}]: expected [pattern, kind] with a pattern of 1 to "
                    f"{MAX_PATTERN} characters"
                )
            if rule[1] not in KINDS:
                raise PayloadError(
                    f"{field}.rules[{i}]: kind must be one of {KINDS}, got {rule[1]!r:.40}"
                )

    def kind(self, name: str) -> str:
        """The layout ``name`` has here: the first matching rule's, else ``default``."""
        for pattern, kind in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return kind
        return self.default

    def box(self, name: str, shape: Sequence[int]) -> Box | None:
        """The part of ``name`` this receiver holds, in global coordinates (``None``: nothing;
        refused with more ranks than elements on the dimension it splits)."""
        return _box(shape, self.kind(name), self.tp_size, self.tp_rank)

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This receiver's part of a whole tensor (a view): to build a receiver from a
        checkpoint, or to check one against a gathered reference. Refused where it holds none
        (``absent``): filter those names out with :meth:`kind`."""
        box = self.box(name, tuple(full.shape))
        if box is None:
            raise PayloadError(f"{name!r}: this receiver holds none of it (absent)")
        return region(full, box)

    # ------------------------------------------------------------------ the wire
    def to_wire(self) -> dict[str, Any]:
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "rules": [list(r) for r in self.rules],
            "default": self.default,
        }

    @classmethod
    def from_wire(cls, data: object, *, field: str = "layout") -> TPLayout:
        """Decode and check a receiver's report; errors name ``field``."""
        if not isinstance(data, Mapping):
            raise PayloadError(f"{field}: expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"tp_rank", "tp_size", "rules", "default"})
        if unknown:
            raise PayloadError(f"{field}: unknown field {unknown[0]!r:.40}")
        rules = data.get("rules", [])
        if not isinstance(rules, list) or len(rules) > MAX_RULES:
            raise PayloadError(f"{field}.rules: expected a list of at most {MAX_RULES} rules")
        for i, rule in enumerate(rules):
            if not isinstance(rule, list) or len(rule) != 2:
                raise PayloadError(f"{field}.rules[{i}]: expected [pattern, kind]")
        out = cls.__new__(cls)
        for key, value in (
            ("tp_rank", data.get("tp_rank")),
            ("tp_size", data.get("tp_size")),
            ("rules", tuple(tuple(r) for r in rules)),
            ("default", data.get("default", "replicated")),
        ):
            object.__setattr__(out, key, value)
        out._check(field)
        return out


def receiver_layouts(
    reports: Sequence[object], metas: Sequence[ParamMeta], *, field: str = "weight_info"
) -> dict[str, Layout]:
    """Every tensor's layout over the receivers, from each receiver's report, in rank order.

    ``reports[i]`` is what receiver ``i`` said (``weight_info()[i]["layout"]``, or a
    :class:`TPLayout`): ``None`` for a receiver holding whole replicas. Receivers with the
    same TP rank in different replicas get the same boxes. Errors name the receiver's field.
    """
    if not reports:
        raise PayloadError(f"{field}: no receivers to plan for")
    parsed: list[TPLayout | None] = []
    for i, report in enumerate(reports):
        where = f"{field}[{i}].layout"
        if report is None or isinstance(report, TPLayout):
            parsed.append(report)
        else:
            parsed.append(TPLayout.from_wire(report, field=where))
    # Receivers share rules (one set per model) and tensors share shapes (one per layer kind):
    # each tensor's kinds are found once per set of rules, each layout built once per shape
    # and kinds, and every receiver's box computed alone (O(1), whatever its TP size).
    rules = {(p.rules, p.default): p for p in parsed if p is not None}
    which = [-1 if p is None else list(rules).index((p.rules, p.default)) for p in parsed]
    made: dict[tuple[tuple[int, ...], tuple[str, ...]], Layout] = {}
    out: dict[str, Layout] = {}
    for meta in metas:
        shape = tuple(int(d) for d in meta.shape)
        kinds = tuple(p.kind(meta.name) for p in rules.values())
        layout = made.get((shape, kinds))
        if layout is None:
            boxes: list[Box | None] = []
            for i, (p, w) in enumerate(zip(parsed, which, strict=True)):
                try:
                    boxes.append(
                        tuple((0, d) for d in shape)
                        if p is None
                        else _box(shape, kinds[w], p.tp_size, p.tp_rank)
                    )
                except PayloadError as e:
                    raise PayloadError(f"{field}[{i}].layout.{e} ({meta.name!r})") from e
            layout = made[(shape, kinds)] = Layout(shape, tuple(boxes))
        out[meta.name] = layout
    return out


def _box(shape: Sequence[int], kind: str, tp_size: int, tp_rank: int) -> Box | None:
    return None if kind == "absent" else tp_box(shape, kind, tp_size, tp_rank)
