"""The ``vllm.general_plugins`` entry point: make wtcore engines selectable in vLLM.

vLLM runs general plugins in every process it starts (API server, engine core, workers), and
possibly more than once per process, so :func:`register` is idempotent: a name vLLM already
holds (registered by an earlier call, by vLLM itself or by another plugin) is skipped, since
vLLM's factory raises on a duplicate. Registering reads only wtcore's entry-point metadata;
no wtcore engine is imported until vLLM builds one.
"""

from __future__ import annotations

import logging

from wtcore_vllm.names import vllm_backend_name

__all__ = ["register"]

log = logging.getLogger(__name__)


def register() -> list[str]:
    """Register each installed wtcore worker engine as ``wtcore_<name>``; return the new names.

    A renamed built-in is registered under its old name as well (``wtcore_local``, now
    ``wtcore_inline``), which loads the same engine with a ``DeprecationWarning`` until 0.3.
    """
    from wtcore.registry import ENGINES
    from wtcore_vllm.engine import adapter_class
    from wtcore_vllm.paths import weight_transfer

    WeightTransferEngineFactory = weight_transfer("factory").WeightTransferEngineFactory

    registry = getattr(WeightTransferEngineFactory, "_registry", None)
    added: list[str] = []
    for engine in [*ENGINES.names(), *ENGINES.renamed]:  # old names too, until they go
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
