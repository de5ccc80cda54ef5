"""Trainer-side sources of weights.

A source has two channels that must agree: ``metadata()`` (cheap, no data moves, used to plan
buckets and to tell receivers what is coming) and iteration (materializes each tensor, which
for FSDP2 is a collective). :func:`iter_checked` is the one place where every engine checks the
two against each other, so that a disagreement is caught before any byte of the offending
tensor is sent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from wtcore.errors import MetadataMismatchError, PayloadError
from wtcore.layout import Box, Layout, Replicate, Shard
from wtcore.meta import ParamMeta, dtype_name, materialize_full_tensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "HeldSource",
    "ModuleSource",
    "ShardedModuleSource",
    "ShardedSource",
    "TensorSource",
    "WeightSource",
    "group_rank",
    "iter_checked",
]


class WeightSource(ABC):
    """Where the trainer's weights come from.

    All trainer ranks iterate a source in lockstep, because materializing a sharded tensor is
    a collective; only the sender then puts the bytes on the wire.
    """

    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every parameter that iteration will yield, in the same order, without moving data."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield fully materialized ``(name, tensor)`` pairs; a fresh pass each call."""


class ModuleSource(WeightSource):
    """A source over ``module.named_parameters()``.

    Metadata reads each parameter's global shape and dtype (a DTensor reports its full shape),
    so no gather happens until iteration.
    """

    def __init__(self, module: torch.nn.Module, *, include_buffers: bool = False) -> None:
        self.module = module
        self.include_buffers = include_buffers

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()
        if self.include_buffers:
            yield from self.module.named_buffers()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(int(d) for d in t.shape)) for n, t in self._named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named():
            yield name, materialize_full_tensor(t.detach())


class ShardedSource(WeightSource):
    """A source each trainer rank iterates for its own part only: no gather, no collective.

    ``metadata()`` still describes the whole model (global shapes); iteration yields this
    rank's part of each tensor, the box ``layouts()[name].boxes[rank]`` (:mod:`wtcore.layout`).
    An engine that does not execute sharded plans refuses such a source at ``send_weights``
    instead of sending a part as if it were the whole tensor.
    """

    rank: int = 0

    @abstractmethod
    def layouts(self) -> dict[str, Layout]:
        """Each tensor's layout over the trainer's ranks (every rank gets the same answer)."""


class ShardedModuleSource(ShardedSource):
    """``module.named_parameters()`` of a sharded module, each rank yielding its local shards.

    A DTensor parameter (FSDP2's ``fully_shard``, TP's ``parallelize_module``) yields
    ``to_local()`` and never calls ``full_tensor()``; its layout comes from its mesh and
    placements (``Shard``, ``Replicate``; a ``Partial`` one, which needs a reduction first, is
    refused). A plain tensor is held whole by every rank. Ranks are the default process
    group's (the mesh's ranks where a DTensor's mesh is a sub-mesh).
    """

    def __init__(self, module: torch.nn.Module, *, include_buffers: bool = False) -> None:
        self._module = ModuleSource(module, include_buffers=include_buffers)
        self.rank, self.world_size = group_rank()

    def metadata(self) -> list[ParamMeta]:
        return self._module.metadata()

    def layouts(self) -> dict[str, Layout]:
        return {name: self._layout(name, t) for name, t in self._module._named()}

    def _layout(self, name: str, t: torch.Tensor) -> Layout:
        shape = tuple(int(d) for d in t.shape)
        mesh = getattr(t, "device_mesh", None)
        if mesh is None:  # a plain tensor: every rank holds all of it
            return Layout.placed(shape, (self.world_size,), (Replicate(),))
        placements: list[Shard | Replicate] = []
        for p in t.placements:  # type: ignore[attr-defined]
            if p.is_shard():
                placements.append(Shard(int(p.dim)))
            elif p.is_replicate():
                placements.append(Replicate())
            else:
                raise PayloadError(
                    f"{name!r}: placement {p} needs a reduction before it can be sent"
                )
        on_mesh = Layout.placed(shape, tuple(mesh.mesh.shape), placements)
        boxes: list[Box | None] = [None] * self.world_size
        for index, global_rank in enumerate(mesh.mesh.flatten().tolist()):
            boxes[int(global_rank)] = on_mesh.boxes[index]
        return Layout(shape, tuple(boxes))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._module._named():
            local = getattr(t, "to_local", None)
            yield name, (local() if callable(local) else t).detach()


class HeldSource(ShardedSource):
    """Pipeline or expert ownership: each rank holds some tensors whole and the rest not at all.

    ``metadata`` describes the whole model, the same on every rank (a model built on the
    ``meta`` device gives it: ``ModuleSource(meta_model).metadata()``); ``held`` is what this
    rank holds, by name, as vLLM's ``held_names()``. A name held by several ranks (tied
    embeddings on the first and last stage) is sent once per receiver, from one of them.
    :meth:`layouts` learns the other ranks' names with one ``all_gather_object`` over the
    default process group, so every rank calls it together (it is cached); a name no rank
    holds is refused there, naming it.
    """

    def __init__(
        self,
        metadata: Sequence[ParamMeta],
        held: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
    ) -> None:
        self._metas = list(metadata)
        by_name = {m.name: m for m in self._metas}
        if len(by_name) != len(self._metas):
            raise PayloadError("metadata: a name is listed twice")
        items = dict(held.items() if isinstance(held, Mapping) else held)
        for name, t in items.items():
            meta = by_name.get(name)
            if meta is None:
                raise PayloadError(f"held: {name!r} is not in the model's metadata")
            got = ParamMeta(name, t.dtype, tuple(int(d) for d in t.shape))
            if got != meta:
                raise MetadataMismatchError(
                    f"held: {_describe(got)} does not match its metadata {_describe(meta)}"
                )
        self._held = items
        self.rank, self.world_size = group_rank()
        self._layouts: dict[str, Layout] | None = None

    def held_names(self) -> list[str]:
        """The names this rank holds, in metadata order."""
        return [m.name for m in self._metas if m.name in self._held]

    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def layouts(self) -> dict[str, Layout]:
        if self._layouts is None:
            names: list[list[str]] = [self.held_names()]
            if self.world_size > 1:
                import torch.distributed as dist

                names = [[] for _ in range(self.world_size)]
                dist.all_gather_object(names, self.held_names())
            holders = [set(n) for n in names]
            orphans = [m.name for m in self._metas if not any(m.name in h for h in holders)]
            if orphans:
                shown = ", ".join(repr(n) for n in orphans[:5])
                raise PayloadError(
                    f"held by no trainer rank: {shown}{', ...' if len(orphans) > 5 else ''} "
                    f"({len(orphans)} of {len(self._metas)} tensors)"
                )
            out: dict[str, Layout] = {}
            for m in self._metas:
                full = tuple((0, int(d)) for d in m.shape)
                boxes = tuple(full if m.name in h else None for h in holders)
                out[m.name] = Layout(tuple(int(d) for d in m.shape), boxes)
            self._layouts = out
        return dict(self._layouts)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.held_names():
            yield name, self._held[name].detach()


def group_rank() -> tuple[int, int]:
    """This process's rank and the size of the default process group (0 and 1 without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TensorSource(WeightSource):
    """A source over an in-memory mapping or list of ``(name, tensor)`` pairs."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
    ) -> None:
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        self._items: list[tuple[str, torch.Tensor]] = items

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta.of(n, t) for n, t in self._items]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self._items))


def _describe(meta: ParamMeta) -> str:
    return f"{meta.name!r} ({dtype_name(meta.dtype)}, shape {list(meta.shape)})"


def iter_checked(
    source: WeightSource, metas: Sequence[ParamMeta] | None = None
) -> Iterator[tuple[ParamMeta, torch.Tensor]]:
    """Iterate ``source``, checking each item against its metadata before yielding it.

    Raises :class:`MetadataMismatchError` on the first item whose name, dtype or shape differs
    from the metadata, when iteration yields more items than the metadata lists, or when it
    stops early. Yielded tensors are contiguous, so callers can view them as bytes.
    """
    expected = list(source.metadata()) if metas is None else list(metas)
    count = 0
    for name, tensor in source:
        if count >= len(expected):
            raise MetadataMismatchError(
                f"source yielded an extra tensor {name!r} at position {count}; "
                f"metadata lists only {len(expected)} tensors"
            )
        meta = expected[count]
        got = ParamMeta(name, tensor.dtype, tuple(int(d) for d in tensor.shape))
        if got != meta:
            raise MetadataMismatchError(
                f"source item {count} does not match its metadata: expected {_describe(meta)}, "
                f"got {_describe(got)}"
            )
        count += 1
        yield meta, tensor if tensor.is_contiguous() else tensor.contiguous()
    if count != len(expected):
        missing = ", ".join(repr(m.name) for m in expected[count : count + 5])
        raise MetadataMismatchError(
            f"source stopped after {count} tensors but metadata lists {len(expected)}; "
            f"missing: {missing}{', ...' if len(expected) - count > 5 else ''}"
        )
