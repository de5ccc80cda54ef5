"""wtcore-http-client: the HTTP control plane (vLLM's RL routes) and its reference receiver.

Names are imported lazily, so that the ``wtcore`` CLI can load ``wtcore serve`` without
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
