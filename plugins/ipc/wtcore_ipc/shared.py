"""Shared weights: the trainer's tensors live in shared memory, so a round copies each byte once.

The ring (:mod:`wtcore_ipc.trainer`) copies every byte twice, once per process: the trainer
packs into a slot, the worker copies out of it. On a CPU host both copies share the memory bus,
which caps a round well below one ``memcpy``. :func:`share_weights` removes the trainer's copy
for good: it moves a module's parameters and buffers, once, into one trainer-owned
shared-memory segment (the tensors keep their identity, only their storage moves, so an
optimizer built before or after keeps working). From then on a round announces the segment and
each tensor's offset in ONE ``update_weights`` call, and every worker copies straight out of the
trainer's tensors into its model.

The segment is a :class:`~wtcore_ipc.shm.StagingSegment` (a sealed memfd) with a single slot
holding every tensor at an aligned offset, so it has the same lifetime rules (locked while the
trainer lives, closed to new workers at :meth:`SharedWeights.close`, freed by the kernel once
the trainer's tensors and every worker's mapping are gone, a crash included) and the same checks
on the worker's side, which copies through its mapping: the seals keep the trainer's tensors
from shrinking under it. The slot header carries the round's
sequence number, stamped before the announcement, so a stale or replayed announcement is
refused. The trainer must not change the weights while ``send_weights`` runs; it is a blocking
call, so a training loop cannot.
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
#: Bytes moved between two :func:`_give_back_freed_memory` calls: the move's peak extra memory.
_TRIM_EVERY = 64 << 20
_LOCK = threading.Lock()


def _give_back_freed_memory() -> None:
    """Return the heap memory of the tensors just moved to the kernel (glibc's ``malloc_trim``).

    Why: a model's tensors of up to a few MiB come from the C heap, and glibc keeps freed heap
    memory for later allocations instead of returning it, so without this a model moved into
    shared memory would hold its memory twice (measured: +512 MiB of RSS for a 512 MiB model
    of 300 tensors). Elsewhere (no glibc) it does nothing.
    """
    from wtcore_ipc.shm import _c_function

    trim = _c_function("malloc_trim")
    if trim is not None:
        trim(0)


class SharedWeights:
    """A module's weights, moved into one shared-memory segment owned by this process.

    Build it with :func:`share_weights`. Keep it alive for as long as rounds should use it;
    :meth:`close` closes the segment to workers (the module keeps working on the mapping, and
    later rounds go through the ring again).
    """

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
        """The segment's name, ``None`` once closed."""
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
        """Close the segment to workers; tensors stay valid (the mapping lives as long as they
        do, and the kernel frees the memory with the last of them)."""
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
    segment, in place: every tensor keeps its identity, only its storage moves.

    Call it once, after the model is built and on the CPU. The segment is a memfd: it counts
    against the process's memory (a container's memory limit), not against ``/dev/shm``, whose
    size does not matter (Docker's default 64 MiB included). Tied parameters stay
    tied (each tensor moves once). Raises :class:`~wtcore.errors.PayloadError` naming the
    first tensor that is not on the CPU.
    """
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
    """Why moving these tensors' storage (what :func:`share_weights` does) could change what
    the program sees, or ``None`` when it cannot: the test the ipc engine runs before it shares
    a model on its own (``IPCTrainerInitInfo.share_weights``).

    Moving is safe when every tensor is a plain dense CPU tensor covering its bytes
    contiguously, no two of them overlap, and nothing else refers to their memory: a view, a
    ``state_dict()`` kept somewhere, a flat buffer the parameters are views of (an optimizer
    or framework that fuses them) would go on seeing the old memory and stop following the
    model. The last test counts the references to each storage (torch's use count), so it
    needs that count; where torch does not offer it, nothing is moved.
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
    """The live :class:`SharedWeights` holding ``t`` and its offset there, or ``None`` (also
    for an empty tensor, which says nothing about where the others are)."""
    if t.numel() == 0:
        return None
    with _LOCK:
        live = list(_LIVE)
    for shared in live:
        off = shared.offset_of(t)
        if off is not None:
            return shared, off
    return None
