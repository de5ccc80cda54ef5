"""Shared weights: the trainer's tensors live in shared memory, so a round copies each byte once.

The segment is a one-slot :class:`~wtcore_ipc.shm.StagingSegment` holding every tensor at an
aligned offset, so it keeps the ring's lifetime rules and checks; see docs/ipc.md.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from wtcore.buckets import align
from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import torch

    from wtcore_ipc.shm import StagingSegment

__all__ = ["SharedWeights", "locate", "share_weights", "why_not_movable"]

_LIVE: weakref.WeakSet[SharedWeights] = weakref.WeakSet()
#: Bytes moved between two :func:`_give_back_freed_memory` calls (the move's peak extra memory).
_TRIM_EVERY = 64 << 20
_LOCK = threading.Lock()


def _give_back_freed_memory() -> None:
    """``malloc_trim``: glibc keeps the freed heap of the moved tensors, so without it a moved
    model would hold its memory twice (+512 MiB RSS for a 512 MiB model). No-op without glibc."""
    from wtcore_ipc.shm import _c_function

    trim = _c_function("malloc_trim")
    if trim is not None:
        trim(0)


class SharedWeights:
    """A module's weights in one shared-memory segment of this process (:func:`share_weights`)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        import torch

        from wtcore_ipc.shm import StagingSegment

        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end = align(end + t.numel() * t.element_size())
        needs = ("share_weights needs the whole model", " or share a smaller model")
        self.segment: StagingSegment | None = StagingSegment(end, 1, needs=needs)
        area = self.segment.slot(0)
        self.nbytes = end
        self._base = area.data_ptr()
        moved = 0
        with torch.no_grad():
            for t, off in zip(tensors, offsets, strict=True):
                n = t.numel() * t.element_size()
                view = area[off : off + n].view(t.dtype).reshape(t.shape)
                view.copy_(t)
                t.data = view  # same tensor object, its storage now in the segment
                moved += n
                if moved >= _TRIM_EVERY:
                    _give_back_freed_memory()
                    moved = 0
        _give_back_freed_memory()
        with _LOCK:
            _LIVE.add(self)

    @property
    def name(self) -> str | None:
        return None if self.segment is None else self.segment.name

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes start in the segment's data area, or ``None`` if not in it."""
        if self.segment is None or t.device.type != "cpu" or not t.is_contiguous():
            return None
        if t.numel() == 0:
            return 0  # no bytes to find (and torch gives empty tensors no address)
        start = t.data_ptr() - self._base
        if start >= 0 and start + t.numel() * t.element_size() <= self.nbytes:
            return start
        return None

    def close(self) -> None:
        """Close the segment to workers; the tensors stay valid (they keep the mapping)."""
        with _LOCK:
            _LIVE.discard(self)
        if self.segment is not None:
            self.segment.close(unmap=False)
            self.segment = None

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_weights(
    weights: torch.nn.Module | Mapping[str, torch.Tensor], *, include_buffers: bool = True
) -> SharedWeights:
    """Move a module's parameters (and buffers), or a mapping's tensors, into one shared-memory
    segment, in place: every tensor keeps its identity (an optimizer and tied weights keep
    working), only its storage moves. Call it once, on the CPU."""
    if isinstance(weights, Mapping):
        named = list(weights.items())
    else:
        named = list(weights.named_parameters())
        if include_buffers:
            named += list(weights.named_buffers())
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for name, t in named:
        if t.device.type != "cpu":
            raise PayloadError(
                f"share_weights: {name!r} is on {t.device}; shared weights are for CPU "
                "trainers (on a GPU the ipc engine's 'cuda' transport applies)"
            )
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append(t)
    return SharedWeights(tensors)


def why_not_movable(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """Why moving these tensors' storage could change what the program sees, or ``None``.

    Anything else referring to their memory (a view, a kept ``state_dict()``, a flat buffer)
    would stop following the model; that is found by counting each storage's references, so a
    torch without that count moves nothing.
    """
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return "this torch cannot tell whether other tensors share the model's memory"
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    seen: set[int] = set()  # a tied tensor is listed once per name
    for name, t in named:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return f"{name!r} is a {type(t).__name__}, not a plain tensor"
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
            return f"{name!r} is not a dense CPU tensor ({t.device}, {t.layout})"
        if t.is_inference():
            return f"{name!r} is an inference tensor"
        if not t.is_contiguous():
            return f"{name!r} is not contiguous"
        if t.numel() and id(t) not in seen:
            seen.add(id(t))
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
    for group in by_storage.values():
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in group
        )
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end:
                return f"{first!r} and {second!r} overlap in memory"
        storage = group[0][1].untyped_storage()
        others = use_count(storage._cdata) - 1 - len(group)  # less this probe and the tensors
        if others > 0:
            return (
                f"{group[0][0]!r} shares its memory with {others} other tensor(s) (a view, a "
                "kept state_dict(), a flat buffer)"
            )
    return None


def locate(t: torch.Tensor) -> tuple[SharedWeights, int] | None:
    """The live :class:`SharedWeights` holding ``t`` and its offset, or ``None`` (also for an
    empty tensor, which says nothing about where the others are)."""
    if t.numel() == 0:
        return None
    with _LOCK:
        live = list(_LIVE)
    for shared in live:
        off = shared.offset_of(t)
        if off is not None:
            return shared, off
    return None
