"""The ``vllm.general_plugins`` entry point: make wtcore engines selectable in vLLM.

vLLM runs it in every process it starts, maybe more than once, and its factory raises on a
duplicate, so :func:`register` skips names vLLM already holds. No wtcore engine is imported
until vLLM builds one.
"""

from __future__ import annotations

import logging

from wtcore_vllm.names import vllm_backend_name

__all__ = ["register"]

log = logging.getLogger(__name__)


def register() -> list[str]:
    """Register each installed wtcore worker engine as ``wtcore_<name>``, and a renamed one's
    old name too (``wtcore_local``, until 0.3); return the new names."""
    from wtcore.registry import ENGINES
    from wtcore_vllm.engine import adapter_class
    from wtcore_vllm.paths import weight_transfer

    WeightTransferEngineFactory = weight_transfer("factory").WeightTransferEngineFactory

    registry = getattr(WeightTransferEngineFactory, "_registry", None)
    added: list[str] = []
    for engine in [*ENGINES.names(), *ENGINES.renamed]:
        name = vllm_backend_name(engine)
        if registry is not None and name in registry:
            continue
        try:
            WeightTransferEngineFactory.register_engine(name, adapter_class(engine))
        except ValueError as e:
            if "already registered" not in str(e):
                raise
            continue
        added.append(name)
    if added:
        log.debug("wtcore-vllm registered weight-transfer backends: %s", ", ".join(added))
    return added
