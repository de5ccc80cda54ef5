"""wtcore-vllm: run any installed wtcore worker engine inside a vLLM server.

vLLM loads :func:`wtcore_vllm.plugin.register` (entry point group ``vllm.general_plugins``) in
each of its processes; it adds every wtcore worker engine to vLLM's weight-transfer engine
factory as ``wtcore_<name>``, so ``--weight-transfer-config '{"backend": "wtcore_nccl"}'``
selects wtcore's ``nccl`` engine. The trainer side needs no vLLM: it is plain wtcore (e.g.
``wtcore_nccl.NCCLTrainerInitInfo`` with ``wtcore_http_client.HTTPWeightSyncClient``).

With tensor parallelism each worker is a sharded receiver of its own (:mod:`wtcore_vllm.tp`,
reported through :mod:`wtcore_vllm.extension`).

Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtcore_vllm.names import PREFIX, vllm_backend_name, wtcore_engine_name

if TYPE_CHECKING:
    from wtcore_vllm.engine import WtcoreVLLMEngine
    from wtcore_vllm.plugin import register

__all__ = ["PREFIX", "WtcoreVLLMEngine", "register", "vllm_backend_name", "wtcore_engine_name"]


def __getattr__(name: str) -> Any:
    # Both need vLLM installed; import them only when asked for.
    if name == "WtcoreVLLMEngine":
        from wtcore_vllm.engine import WtcoreVLLMEngine

        return WtcoreVLLMEngine
    if name == "register":
        from wtcore_vllm.plugin import register

        return register
    raise AttributeError(f"module 'wtcore_vllm' has no attribute {name!r}")
