"""Delta rounds for wtcore: send only what changed since the receivers' version.

One record, :data:`ROUNDS` (``wtcore.round_policies``), names the trainer half
(:class:`~wtcore_delta.trainer.DeltaRounds`) and the receiver layer
(:class:`~wtcore_delta.receiver.DeltaSink`), so the core imports none of it and each side
imports only its own half. See docs/architecture.md, "Delta rounds".
"""

from __future__ import annotations

from wtcore.registry import Halves

__all__ = ["ROUNDS"]

#: ``delta`` in ``wtcore.round_policies``.
ROUNDS = Halves(
    trainer="wtcore_delta.trainer:DeltaRounds", worker="wtcore_delta.receiver:DeltaSink"
)
