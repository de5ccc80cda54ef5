"""Sharded rounds on mooncake: each receiver reads its chunks straight out of the trainer ranks'
own parts.

Why reads out of the parts: pull is this engine's direction (:mod:`wtcore_mooncake.trainer`),
and in a sharded round the bytes a receiver needs already lie, contiguous, in each trainer
rank's part of each tensor. So every trainer rank registers the parts it sends (contiguous
ones as they are, others copied once) with its own transfer engine, and rank 0 sends the
receivers one update after the plan with every rank's endpoint and where each of its parts
lies: ``{"senders": [{"endpoint": "host:port", "tensors": {name: [address, bytes]}}]}``. A
trainer rank allocates no staging, and packs nothing.

Each receiver cuts its pairs into the plan's buckets, as every engine does
(:mod:`wtcore_kit.pairs`), and reads each bucket with one batched read, one entry per
contiguous run of each chunk's region, into one registered buffer of its own; then hands it to
its :class:`~wtcore_kit.pairs.PairAssembler` (sender, order and size checked). Every read is
computed from the plan, inside a part whose announced size was checked against the plan
first, so a forged update can name no other memory than the parts' (and memory the trainer
did not register is refused by Mooncake there). The parts stay registered, and unchanged,
until rank 0's update has returned from every receiver, which all ranks wait for together.

A trainer rank does not see the reads, so its ``bytes_sent`` is its planned chunks; each
receiver counts what it read and refuses to finish a round short of its plan.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, TransferError
from wtcore.layout import is_int

if TYPE_CHECKING:
    import torch

    from wtcore.layout import Box
    from wtcore.plan import PlannedRound

__all__ = ["SendersUpdate", "byte_runs", "register_parts"]

_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9_.:\-\[\]]{1,253}):(?P<port>[0-9]{1,5})")
_ADDRESS_LIMIT = 1 << 63


def parts_of(planned: PlannedRound, src: int) -> dict[str, int]:
    """The parts trainer rank ``src`` sends in ``planned``: ``{name: bytes}``."""
    sends = {c.name for c in planned.plan.chunks if c.src == src}
    return {
        m.name: math.prod(lay.local_shape(src)) * m.dtype.itemsize
        for m, lay in zip(planned.metas, planned.senders, strict=True)
        if m.name in sends
    }


@dataclass
class SendersUpdate:
    """Where every trainer rank's parts lie: ``{"endpoint", "tensors"}`` each."""

    senders: list[Any]

    def checked(
        self, planned: PlannedRound, ranks: list[int]
    ) -> dict[int, tuple[str, dict[str, int]]]:
        """For each of ``ranks``: its endpoint and ``{name: address}``, every entry checked
        against the plan (a ``PayloadError`` naming it)."""
        world = planned.senders[0].world_size if planned.senders else 0
        if len(self.senders) != world:
            raise PayloadError(
                f"update_info.senders: the plan has {world} trainer ranks, got "
                f"{len(self.senders)} entries"
            )
        out = {}
        for s in ranks:
            where, e = f"update_info.senders[{s}]", self.senders[s]
            if not isinstance(e, dict) or set(e) != {"endpoint", "tensors"}:
                raise PayloadError(f"{where}: expected an object of endpoint and tensors")
            m = _ENDPOINT.fullmatch(e["endpoint"]) if isinstance(e["endpoint"], str) else None
            if m is None or not 0 < int(m.group("port")) < 65536:
                raise PayloadError(f"{where}.endpoint: expected host:port")
            want, got = parts_of(planned, s), e["tensors"]
            if not isinstance(got, dict) or set(got) != set(want):
                raise PayloadError(
                    f"{where}.tensors: expected exactly the {len(want)} parts this rank sends"
                )
            addresses = {}
            for name, nbytes in want.items():
                entry = got[name]
                ok = isinstance(entry, list) and len(entry) == 2 and all(map(is_int, entry))
                if not ok or not 0 < entry[0] < _ADDRESS_LIMIT or entry[1] != nbytes:
                    raise PayloadError(
                        f"{where}.tensors[{name!r}]: expected [address, {nbytes}] (the part's "
                        f"planned bytes), got {entry!r:.80}"
                    )
                addresses[name] = entry[0]
            out[s] = (e["endpoint"], addresses)
        return out


def byte_runs(shape: tuple[int, ...], box: Box, itemsize: int) -> list[tuple[int, int]]:
    """``box`` of a contiguous tensor of ``shape`` as ``(byte offset, bytes)`` runs, in order.

    The trailing dimensions the box covers whole join the run, so a box of whole rows is one
    run and a column block is one run per row.
    """
    if any(b <= a for a, b in box):
        return []
    strides = [itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape))]
    k = len(shape)  # dims k.. are covered whole
    while k > 0 and box[k - 1] == (0, shape[k - 1]):
        k -= 1
    if k == 0:
        return [(0, itemsize * math.prod(shape))]
    run = (box[k - 1][1] - box[k - 1][0]) * strides[k - 1]
    outer = [range(a, b) for a, b in box[: k - 1]]
    start = box[k - 1][0] * strides[k - 1]
    return [
        (start + sum(i * st for i, st in zip(idx, strides, strict=False)), run)
        for idx in itertools.product(*outer)
    ]


def register_parts(
    engine: Any, local: dict[str, torch.Tensor], sizes: dict[str, int]
) -> dict[str, torch.Tensor]:
    """The parts named in ``sizes``, contiguous on the CPU, each registered with ``engine``.

    A part that is not contiguous, not on the CPU, or that Mooncake will not register where
    it lies (it overlaps a registered region) is copied once. On a failure every part
    registered so far is unregistered again.
    """
    parts: dict[str, torch.Tensor] = {}
    try:
        for name in sizes:
            t = local.get(name)
            if t is None:
                raise PayloadError(f"{name!r}: this trainer rank holds no part of it")
            t = t.detach().to("cpu").contiguous()
            if engine.register_memory(t.data_ptr(), sizes[name]) != 0:
                t = t.clone()
                if engine.register_memory(t.data_ptr(), sizes[name]) != 0:
                    raise TransferError(f"Mooncake could not register the part of {name!r}")
            parts[name] = t
    except BaseException:
        for t in parts.values():
            engine.unregister_memory(t.data_ptr())
        raise
    return parts
