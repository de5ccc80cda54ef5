"""Sharded sources: each trainer rank yields its own part of each tensor, and the source
hands ``send_weights`` (which knows no sharding) the round that sends parts: the sharded round
(:func:`~wtcore.sharded.round.run_sharded_round`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta
from wtcore.sharded.layout import Box, Layout, Replicate, Shard
from wtcore.sharded.round import group_rank, run_sharded_round
from wtcore.source import ModuleSource, WeightSource, _describe

if TYPE_CHECKING:
    import torch

    from wtcore.stats import TransferStats

__all__ = ["HeldSource", "ShardedModuleSource", "ShardedSource"]


class ShardedSource(WeightSource):
    """A source each trainer rank iterates for its own part only: no gather, no collective.

    ``metadata()`` still describes the whole model (global shapes); iteration yields this
    rank's part of each tensor, the box ``layouts()[name].boxes[rank]``
    (:mod:`wtcore.sharded.layout`). An engine that does not execute sharded plans refuses such
    a source at ``send_weights`` instead of sending a part as if it were the whole tensor.
    """

    rank: int = 0

    @abstractmethod
    def layouts(self) -> dict[str, Layout]:
        """Each tensor's layout over the trainer's ranks (every rank gets the same answer)."""

    def round_driver(
        self, engine: Any, verify: bool
    ) -> Callable[[WeightSource, TransferStats, str | None], None]:
        """The sharded round, refusing first (before anything moves) what it cannot do yet."""
        backend = engine.init_info.backend
        if not engine.executes_plans:
            raise PayloadError(
                f"send_weights: the {backend} engine does not execute sharded plans yet; send "
                "a ModuleSource (rank 0 gathers each tensor whole)"
            )
        if verify:
            raise PayloadError("verify: not supported for a sharded source yet (send it False)")
        if engine.init_info.delta:
            raise PayloadError(
                f"delta: not supported for a sharded source yet (the {backend} engine was "
                f"initialized with delta={engine.init_info.delta!r})"
            )
        return partial(run_sharded_round, engine)


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
                raise PayloadError(
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
