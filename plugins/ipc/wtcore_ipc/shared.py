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

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from wtcore.buckets import align
from wtcore.errors import PayloadError

if TYPE_CHECKING:
    import torch

    from wtcore_ipc.shm import StagingSegment

__all__ = ["SharedWeights", "locate", "share_weights"]

_LIVE: weakref.WeakSet[SharedWeights] = weakref.WeakSet()
_LOCK = threading.Lock()


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
        with torch.no_grad():
            for t, off in zip(tensors, offsets, strict=True):
                n = t.numel() * t.element_size()
                view = area[off : off + n].view(t.dtype).reshape(t.shape)
                view.copy_(t)
                t.data = view  # same tensor object, its storage now in the segment
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
