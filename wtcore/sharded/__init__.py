"""Sharded rounds: each trainer rank sends its own shards, each receiver gets only its slice.

Layouts (:mod:`.layout`), the plan (:mod:`.plan`), receivers' reports (:mod:`.receiver_layout`),
the sources (:mod:`.source`) and their round (:mod:`.round`). ``send_weights`` knows none of
it: a sharded source hands it this round. Nothing here imports torch, nor ``import wtcore`` this.
"""

from __future__ import annotations

from wtcore.sharded.layout import Layout, Replicate, Shard, tp_layout
from wtcore.sharded.plan import Chunk, Plan, PlannedRound, plan_transfer
from wtcore.sharded.receiver_layout import TPLayout, receiver_layouts
from wtcore.sharded.round import run_sharded_round
from wtcore.sharded.source import HeldSource, ShardedModuleSource, ShardedSource

__all__ = [
    "Chunk",
    "HeldSource",
    "Layout",
    "Plan",
    "PlannedRound",
    "Replicate",
    "Shard",
    "ShardedModuleSource",
    "ShardedSource",
    "TPLayout",
    "plan_transfer",
    "receiver_layouts",
    "run_sharded_round",
    "tp_layout",
]
