"""wtcore-vllm: every installed wtcore worker engine as a vLLM weight-transfer backend,
``wtcore_<name>`` (docs/vllm.md). The trainer needs no vLLM; importing this package imports
neither vLLM nor torch."""

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
