"""wtcore-trl: TRL's ``GRPOTrainer`` syncs its vLLM server through any wtcore engine.

:func:`install` puts :class:`~wtcore_trl.client.WtcoreVLLMClient` where TRL looks its
``VLLMClient`` up, so TRL runs unchanged and only the weight sync is wtcore's (docs/trl.md).
Nothing heavy is imported until :func:`install` runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_TRL", "follow", "install"]

#: The TRL releases this adapter is tested with (their client surface is checked at install).
SUPPORTED_TRL = ("1.16",)


def install(backend: str = "nccl", *, timeout_s: float = 300.0, **options: Any) -> type:
    """Make every TRL trainer built from now on sync its vLLM server through wtcore.

    ``options`` are the engine's init-info fields, checked now; the rendezvous fields come from
    TRL's settings. Returns the client class it installed.
    """
    from wtcore_trl.client import client_class, trl_generation_module

    module: Any = trl_generation_module()
    cls = client_class(backend, options, timeout_s)
    module.VLLMClient = cls
    return cls


def follow(trainer: Any, *, lora: Any = None) -> None:
    """Publish each sync as ``weight_version = str(trainer.state.global_step)``; with ``lora``, a
    ``wtcore_vllm.lora.LoRASource`` of ``trainer.model``, sync that adapter alone (nothing
    merged) and generate with it, by its name (docs/trl.md)."""
    from wtcore_trl.client import follow_steps

    follow_steps(trainer, lora)
