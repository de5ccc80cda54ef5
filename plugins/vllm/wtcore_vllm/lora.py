"""LoRA adapter rounds: a trainer sends a PEFT adapter's tensors; vLLM serves them under a name.

A PEFT trainer changes only its adapter (megabytes), so a round should move only that, not the
merged model (gigabytes). The trainer sends :class:`LoRASource` (the adapter's tensors, in PEFT's
saved names, through any wtcore engine), which marks each update of its round with the adapter's
name and PEFT config (:data:`LORA_KEY`). The vLLM adapter (:class:`~wtcore_vllm.engine.
WtcoreVLLMEngine`) buffers such a round in its host staging and never touches the base weights:
its finish writes the adapter in PEFT's layout into ``$VLLM_LORA_RESOLVER_CACHE_DIR/<name>``,
after vLLM's own LoRA loader has accepted it from a scratch folder beside it.

Why a folder: vLLM builds a LoRA from tensors in memory (``LoRAModel.from_lora_tensors``), but it
keeps none for long. Its worker drops every cached adapter after each weight update
(``reset_lora_state``) and on LRU eviction, and loads it again from the request's ``lora_path``;
its API server learns a name only by such a load (``/v1/load_lora_adapter``, a resolver, or
``--lora-modules``). So the adapter must live at a path the worker can read, and with vLLM's
filesystem resolver (``VLLM_LORA_RESOLVER_CACHE_DIR``) the first request naming it registers
it; after each later round the worker's own reset makes the next request load the new one. The
bytes on the wire are the adapter's; the folder is local to the server. Changes of rank or
target modules between rounds need nothing more: every round is loaded afresh.

Importing this module imports neither vLLM nor PEFT (the trainer side needs neither).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta, materialize_full_tensor
from wtcore.rounds import RoundStampingClient
from wtcore.source import WeightSource
from wtcore.stats import TransferStats

__all__ = ["LORA_KEY", "LoRASource", "LoRAWriter", "lora_round"]

#: The ``update_info`` key that marks an adapter round: ``{"name": ..., "config": {...}}``.
LORA_KEY = "wtcore_lora"
#: What an adapter's name may look like: it is a folder name on the server and a model name.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _check_name(name: object, field: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise PayloadError(
            f"{field}: expected a name matching {_NAME_RE.pattern}, got {name!r:.80}"
        )
    return name


class LoRASource(WeightSource):
    """The adapter ``adapter`` of a PEFT model, served by vLLM as the model ``name``.

    It yields what PEFT's ``save_pretrained`` saves (``base_model.model.<module>.lora_A.weight``
    and ``lora_B``), read from the live parameters at each round, and stamps every update of
    its round with ``name`` and the adapter's PEFT config.
    """

    def __init__(self, model: Any, name: str, *, adapter: str = "default") -> None:
        self.model, self.name, self.adapter = model, _check_name(name, "name"), adapter
        if adapter not in getattr(model, "peft_config", {}):
            raise PayloadError(f"adapter: the model has no PEFT adapter {adapter!r}")

    def _tensors(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict  # type: ignore[import-not-found]

        return dict(get_peft_model_state_dict(self.model, adapter_name=self.adapter))

    def config(self) -> dict[str, Any]:
        """The adapter's PEFT config, as ``adapter_config.json`` holds it (sets as lists)."""
        raw = self.model.peft_config[self.adapter].to_dict()
        return dict(json.loads(json.dumps(raw, default=sorted)))

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._tensors().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors().items():
            yield name, materialize_full_tensor(t.detach())  # as ModuleSource: a DTensor whole

    def round_driver(
        self, engine: Any, verify: bool
    ) -> Callable[[WeightSource, TransferStats, str | None], None]:
        """The whole round, every update marked (:attr:`RoundStampingClient.marks`)."""

        def drive(src: WeightSource, stats: TransferStats, version: str | None) -> None:
            if isinstance(engine.client, RoundStampingClient):  # the sender's, for this round
                engine.client.marks = {LORA_KEY: {"name": self.name, "config": self.config()}}
            engine._whole_round(src, stats, version)

        return drive


class LoRAWriter:
    """Server side: where an adapter round goes (vLLM's resolver cache), and its commit."""

    def __init__(self, engine: Any, mark: object) -> None:
        from vllm import envs

        field = f"update_info.{LORA_KEY}"
        if not isinstance(mark, dict) or not isinstance(mark.get("config"), dict):
            raise PayloadError(f"{field}: expected {{'name': str, 'config': object}}")
        self.name = _check_name(mark.get("name"), f"{field}.name")
        self.config: dict[str, Any] = mark["config"]
        if self.config.get("peft_type", "LORA") != "LORA":
            raise PayloadError(f"{field}.config.peft_type: {self.config['peft_type']!r}, not LORA")
        manager = getattr(engine.model, "lora_manager", None)
        cache = envs.VLLM_LORA_RESOLVER_CACHE_DIR
        if manager is None or not cache or not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
            raise PayloadError(
                f"{field}: this vLLM server takes no adapter rounds; serve with --enable-lora "
                "--max-lora-rank N and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, "
                "VLLM_LORA_RESOLVER_CACHE_DIR=<a folder> in its environment"
            )
        self.engine, self.manager, self.cache = engine, manager, str(cache)

    def save(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write the adapter into a scratch folder, have vLLM's loader accept it, then move it
        into place: a refused round leaves the name serving its previous adapter."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest
        from vllm.lora.worker_manager import WorkerLoRAManager

        config = {
            **self.config,
            "peft_type": "LORA",
            "base_model_name_or_path": self.engine.model_config.model,  # the resolver checks it
        }
        scratch = tempfile.mkdtemp(prefix=".wtcore-", dir=self.cache)
        try:
            save_file(dict(tensors), os.path.join(scratch, "adapter_model.safetensors"))
            with open(os.path.join(scratch, "adapter_config.json"), "w") as f:
                json.dump(config, f)
            # vLLM's own load, every check included (rank limit, modules the model supports)
            checker = WorkerLoRAManager(
                self.engine.vllm_config, self.engine.device, self.engine.model.embedding_modules
            )
            checker._adapter_manager = self.manager
            try:
                checker._load_adapter(LoRARequest(self.name, 1, scratch))
            except Exception as e:
                raise PayloadError(
                    f"update_info.{LORA_KEY}: vLLM's LoRA loader refused adapter {self.name!r}: {e}"
                ) from e
            final = os.path.join(self.cache, self.name)
            os.makedirs(final, exist_ok=True)
            for file in ("adapter_model.safetensors", "adapter_config.json"):
                os.replace(os.path.join(scratch, file), os.path.join(final, file))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def lora_round(
    engine: Any, update_info: dict[str, Any]
) -> tuple[dict[str, Any], LoRAWriter | None]:
    """``update_info`` without the adapter mark, and the round's :class:`LoRAWriter` (``None``:
    a weight round). The round's first update decides; every later one must agree."""
    mark = update_info.get(LORA_KEY)
    if mark is not None:
        update_info = {k: v for k, v in update_info.items() if k != LORA_KEY}
    if engine._staged is None:  # the round's first update
        return update_info, None if mark is None else LoRAWriter(engine, mark)
    writer: LoRAWriter | None = engine._lora
    name = mark.get("name") if isinstance(mark, dict) else mark
    if (writer is None and mark is not None) or (writer is not None and name != writer.name):
        first = "no adapter" if writer is None else f"adapter {writer.name!r}"
        raise PayloadError(
            f"update_info.{LORA_KEY}: every update of a round must name what its first did "
            f"({first})"
        )
    return update_info, writer
