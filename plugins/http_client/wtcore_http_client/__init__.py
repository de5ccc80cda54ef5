"""wtcore-http-client: the HTTP control plane of wtcore.

* :class:`HTTPWeightSyncClient` (registered as ``http`` in ``wtcore.clients``) speaks vLLM's
  RL routes to one or more receivers; :class:`VLLMWeightSyncClient` is the same with one
  ``weight_info()`` entry per vLLM worker (sharded rounds into TP > 1,
  :mod:`wtcore_http_client.vllm_workers`);
* :mod:`wtcore_http_client.routes` and :mod:`wtcore_http_client.server` are the reference
  receiver: a :class:`wtcore.WeightSyncWorker` behind the same routes;
* ``wtcore serve`` (:mod:`wtcore_http_client.commands`) runs that receiver hosting a model.

Names are imported lazily, so that the ``wtcore`` CLI can load the ``serve`` command without
importing ``requests``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wtcore_http_client.client import HTTPWeightSyncClient
    from wtcore_http_client.errors import (
        HTTPConnectionError,
        HTTPStatusError,
        ReceiverTimeoutError,
    )
    from wtcore_http_client.routes import ReceiverRoutes, Response
    from wtcore_http_client.server import ReceiverHTTPServer, ServerLimits
    from wtcore_http_client.vllm_workers import VLLMWeightSyncClient

__all__ = [
    "HTTPConnectionError",
    "HTTPStatusError",
    "HTTPWeightSyncClient",
    "ReceiverHTTPServer",
    "ReceiverRoutes",
    "ReceiverTimeoutError",
    "Response",
    "ServerLimits",
    "VLLMWeightSyncClient",
]

_WHERE = {
    "HTTPWeightSyncClient": "client",
    "HTTPConnectionError": "errors",
    "HTTPStatusError": "errors",
    "ReceiverTimeoutError": "errors",
    "ReceiverRoutes": "routes",
    "Response": "routes",
    "ReceiverHTTPServer": "server",
    "ServerLimits": "server",
    "VLLMWeightSyncClient": "vllm_workers",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'wtcore_http_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"wtcore_http_client.{module}"), name)
