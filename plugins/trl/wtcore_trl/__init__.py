"""wtcore-trl: TRL's ``GRPOTrainer`` syncs its vLLM server through any wtcore engine.

TRL's trainers generate through ``trl.generation.vllm_generation.VLLMGeneration``, which builds
its ``VLLMClient`` by the name it finds in its own module when the trainer is constructed.
:func:`install` puts :class:`~wtcore_trl.client.WtcoreVLLMClient` under that name, so TRL's
code runs unchanged and only the weight sync (``init_communicator``, ``update_named_params``,
``close_communicator``) is wtcore's; generation, ``reset_prefix_cache`` and the rest stay
TRL's. :func:`follow` makes each sync's ``weight_version`` the trainer's global step.

Nothing heavy is imported until :func:`install` runs (it imports TRL).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_TRL", "follow", "install"]

#: The TRL releases this adapter is tested with (their client surface is checked at install).
SUPPORTED_TRL = ("1.16",)


def install(backend: str = "nccl", *, timeout_s: float = 300.0, **options: Any) -> type:
    """Make every TRL trainer built from now on sync its vLLM server through wtcore.

    ``backend`` is any installed wtcore trainer engine (``nccl``: NCCL on GPUs, gloo on CPU;
    ``ipc`` when the server shares the host; ...); ``options`` are its init-info fields
    (``delta=True``, ``packed_buffer_size_bytes=...``), checked now, by name. The address,
    port and world size a rendezvous needs are filled in from TRL's own settings. Returns the
    client class it installed.
    """
    from wtcore_trl.client import client_class, trl_generation_module

    module: Any = trl_generation_module()
    cls = client_class(backend, options, timeout_s)
    module.VLLMClient = cls
    return cls


def follow(trainer: Any) -> None:
    """Publish each sync as ``weight_version = str(trainer.state.global_step)``."""
    from wtcore_trl.client import follow_steps

    follow_steps(trainer)
