"""``--worker-extension-cls wtcore_vllm.extension.WtcoreWorkerExtension``: what each vLLM worker
reports to a trainer.

Why an extension: vLLM's ``GET /weight_info`` answers the server's weight version only, while
a trainer planning a sharded round needs every worker's layout (one receiver per TP rank). vLLM
reaches every worker with ``POST /collective_rpc`` (on with ``VLLM_SERVER_DEV_MODE=1``, which
the RL routes need anyway), calling a method of the worker by name; this class gives the
worker that method, :meth:`WtcoreWorkerExtension.wtcore_weight_info`, and
:class:`wtcore_http_client.VLLMWeightSyncClient` calls it. A server that runs an extension of
its own subclasses this one. Importing this module imports neither vLLM nor torch.
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
        """This worker's report: ``rank``, ``world_size`` and ``layout`` (wtcore's
        ``TPLayout`` on the wire; ``None`` at TP = 1), and its last round's seconds."""
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
