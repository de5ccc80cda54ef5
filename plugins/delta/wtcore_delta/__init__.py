"""Delta rounds for wtcore: send only what changed since the receivers' version.

A layer on the core, found by name so that the core imports none of it: the trainer half
(:class:`wtcore_delta.trainer.DeltaRounds`) is the ``delta`` round policy that
``TrainerInitInfo(delta=True)`` selects (entry-point group ``wtcore.round_policies``), and the
receiver half (:class:`wtcore_delta.receiver.DeltaSink`) is the ``delta`` receiver layer every
worker puts first in its sink chain (``wtcore.receiver_layers``). Without this distribution a
worker reports ``delta: false`` and a trainer with ``delta=True`` is refused, naming
``pip install wtcore-delta``. :mod:`wtcore_delta.header` is the round's header,
:mod:`wtcore_delta.codec` the patch codec. See docs/architecture.md, "Delta rounds".
"""

from __future__ import annotations

__all__: list[str] = []
