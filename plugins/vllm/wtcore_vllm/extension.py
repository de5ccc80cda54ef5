"""``--worker-extension-cls wtcore_vllm.extension.WtcoreWorkerExtension``: what each vLLM worker
reports to a trainer.

vLLM's ``/weight_info`` has no per-worker part, and a sharded round's plan needs each worker's
layout: :class:`wtcore_http_client.VLLMWeightSyncClient` reads it through ``/collective_rpc``.
Subclass it for an extension of your own. Imports neither vLLM nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wtcore.errors import PluginLoadError

if TYPE_CHECKING:
    from wtcore_vllm.engine import WtcoreVLLMEngine

__all__ = ["RPC_METHOD", "WtcoreWorkerExtension"]

#: The worker method's name, as ``/collective_rpc`` calls it (the HTTP client spells it too:
#: ``wtcore_http_client.vllm_workers.WORKER_INFO_METHOD``).
RPC_METHOD = "wtcore_weight_info"


class WtcoreWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``)."""

    def wtcore_weight_info(self) -> dict[str, Any]:
        """This worker's report (:meth:`~wtcore_vllm.engine.WtcoreVLLMEngine.worker_info`)."""
        return self._wtcore_engine().worker_info()

    def _wtcore_engine(self) -> WtcoreVLLMEngine:
        from wtcore_vllm.engine import WtcoreVLLMEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WtcoreVLLMEngine):
            raise PluginLoadError(
                "the wtcore worker extension: this vLLM worker runs no wtcore engine; start the "
                'server with --weight-transfer-config \'{"backend": "wtcore_<engine>"}\''
            )
        return engine
