"""Delta rounds for wtcore: send only what changed since the receivers' version.

A layer on the core, found by name so that the core imports none of it: the trainer half
(:class:`wtcore_delta.trainer.DeltaRounds`) is the ``delta`` round policy that
``TrainerInitInfo(delta=True)`` selects, and the receiver half
(:class:`wtcore_delta.receiver.DeltaSink`) is the ``delta`` receiver layer every worker puts
first in its sink chain: one record, :data:`ROUNDS`, in the entry-point group
``wtcore.round_policies``, so each side imports only its own half. Without this distribution a
worker reports ``delta: false`` and a trainer with ``delta=True`` is refused, naming
``pip install wtcore-delta``. :mod:`wtcore_delta.header` is the round's header,
:mod:`wtcore_delta.codec` the patch codec. See docs/architecture.md, "Delta rounds".
"""

from __future__ import annotations

from wtcore.registry import Halves

__all__ = ["ROUNDS"]

#: ``delta`` in ``wtcore.round_policies``.
ROUNDS = Halves(
    trainer="wtcore_delta.trainer:DeltaRounds", worker="wtcore_delta.receiver:DeltaSink"
)
