"""The TRL client whose weight sync is a wtcore trainer engine (imports TRL).

TRL's own sync needs CUDA and silently syncs nothing without libnccl; this subclass keeps the
rest of TRL's client and replaces ``init_communicator``, ``update_named_params`` and
``close_communicator`` (docs/trl.md). A failed sync raises, naming the server, so training
never goes on over stale weights.
"""

from __future__ import annotations

import atexit
import socket
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from wtcore.errors import PayloadError, PluginLoadError, ProtocolStateError
from wtcore.parse import field_names, parse_dataclass
from wtcore.registry import CLIENTS, TRAINER_ENGINES
from wtcore.source import WeightSource
from wtcore.stats import TransferStats
from wtcore_trl import SUPPORTED_TRL
from wtcore_trl.source import StreamSource

__all__ = [
    "client_class",
    "engine_device",
    "follow_steps",
    "local_address",
    "trl_generation_module",
]

#: What TRL's client must have for this subclass to stand in for it.
_SURFACE = ("init_communicator", "update_named_params", "close_communicator", "reset_prefix_cache")


def trl_generation_module() -> ModuleType:
    """TRL's ``vllm_generation`` module, once TRL's version and client are checked."""
    try:
        import trl
        from trl.generation import vllm_generation
    except ImportError as e:
        raise PluginLoadError(
            f"wtcore-trl needs TRL {' or '.join(SUPPORTED_TRL)} (pip install 'wtcore-trl[trl]'), "
            f"and TRL's vLLM client needs vLLM: {e}"
        ) from e
    version = str(getattr(trl, "__version__", "unknown"))
    client = getattr(vllm_generation, "VLLMClient", None)
    missing = [m for m in _SURFACE if not callable(getattr(client, m, None))]
    if not version.startswith(tuple(v + "." for v in SUPPORTED_TRL)) or missing:
        raise PluginLoadError(
            f"wtcore-trl supports TRL {', '.join(SUPPORTED_TRL)}, found TRL {version}"
            + (f" whose VLLMClient lacks {', '.join(missing)}" if missing else "")
            + "; install a supported TRL (pip install 'wtcore-trl[trl]')"
        )
    module: ModuleType = vllm_generation
    return module


def local_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (a connected UDP socket sends nothing)."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def engine_device(device: Any) -> str:
    """TRL's ``init_communicator(device)`` as an engine's ``device`` field (an int is a CUDA
    index), so the engine's transport follows the trainer's device."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise PayloadError(f"device: expected a CUDA index >= 0, got {device}")
        return f"cuda:{device}"
    kind = getattr(device, "type", None)  # a torch.device, without importing torch here
    if isinstance(kind, str):
        index = getattr(device, "index", None)
        return kind if index is None else f"{kind}:{int(index)}"
    if isinstance(device, str) and device:
        return device
    raise PayloadError(f"device: expected a torch.device, a str or a CUDA index, got {device!r}")


def trainer_info(backend: str, options: dict[str, Any], derived: dict[str, Any]) -> Any:
    """The engine's trainer init info: TRL-derived fields it has, overridden by ``options``."""
    cls = TRAINER_ENGINES.load(backend).init_info_cls
    names = set(field_names(cls))
    if "rank" in options:
        raise PayloadError("rank: set by wtcore-trl (TRL's main process is the sender, rank 0)")
    data = {k: v for k, v in derived.items() if k in names} | options | {"rank": 0}
    return parse_dataclass(cls, data, what=f"wtcore_trl.install(backend={backend!r}) options")


def client_class(backend: str, options: dict[str, Any], timeout_s: float) -> type:
    """A ``VLLMClient`` subclass bound to one wtcore engine; checks the options now."""
    TRAINER_ENGINES.load(backend)  # an unknown or broken engine fails at install, not mid-run
    placeholder = {"master_address": "127.0.0.1", "address": "127.0.0.1", "master_port": 1}
    trainer_info(backend, options, {**placeholder, "world_size": 2})
    base = trl_generation_module().VLLMClient

    class WtcoreVLLMClient(base):  # type: ignore[misc, valid-type]
        wtcore_backend = backend
        wtcore_options = dict(options)
        wtcore_timeout_s = timeout_s
        #: The version each sync publishes (:func:`follow_steps` sets it); default: a count.
        step_of: Callable[[], int] | None = None
        #: What every sync of this client did, in order (``TransferStats``).
        syncs: list[TransferStats]
        #: The adapter each sync sends in place of TRL's stream (``follow(trainer, lora=...)``).
        lora: WeightSource | None = None

        def init_communicator(self, device: Any = 0) -> None:
            self.close_communicator()
            self.syncs = []
            sync = CLIENTS.load("http")(self.base_url, timeout_s=self.wtcore_timeout_s)
            try:
                address = local_address(str(self.host), int(self.group_port))
                derived = {
                    "master_address": address,
                    "address": address,
                    "master_port": int(self.group_port),
                    "world_size": 1 + sync.get_world_size(),
                    "device": engine_device(device),
                }
                info = trainer_info(self.wtcore_backend, self.wtcore_options, derived)
                engine_cls = TRAINER_ENGINES.load(self.wtcore_backend)
                self.communicator = engine_cls.trainer_init(info, client=sync)
            except BaseException:
                sync.close()
                raise
            self._wtcore_client = sync
            if not getattr(self, "_wtcore_atexit", False):  # once per client, not per init
                atexit.register(self.close_communicator)
                self._wtcore_atexit = True

        def update_named_params(
            self, metadata: list[Any], named_params: Iterator[tuple[str, Any]]
        ) -> None:
            if self.communicator is None:
                raise ProtocolStateError(
                    f"{self.base_url}: update_named_params before init_communicator"
                )
            step = self.step_of() if self.step_of is not None else len(self.syncs)
            source = StreamSource(metadata, named_params) if self.lora is None else self.lora
            stats = self.communicator.send_weights(source, weight_version=str(step))
            self.syncs.append(stats)

        def close_communicator(self) -> None:
            engine, self.communicator = getattr(self, "communicator", None), None
            sync = getattr(self, "_wtcore_client", None)
            self._wtcore_client = None
            try:
                if engine is not None:
                    engine.shutdown()
            finally:
                if sync is not None:
                    sync.close()

    WtcoreVLLMClient.__doc__ = f"TRL's vLLM client, syncing through wtcore's {backend!r} engine."
    return WtcoreVLLMClient


def follow_steps(trainer: Any, lora: Any = None) -> None:
    """Point the trainer's vLLM client at its global step (only TRL's main process has one) and,
    with ``lora`` (a ``wtcore_vllm.lora.LoRASource``), at its adapter: every sync sends the
    adapter alone, and TRL generates with it (``lora.name``)."""
    generation = getattr(trainer, "vllm_generation", None)
    if lora is not None and generation is not None:
        if generation._dist.is_zero3 or generation._dist.is_fsdp:
            raise PluginLoadError("lora: the adapter must be whole on each rank (no ZeRO-3, FSDP)")
        # TRL's walk merges the adapter into the base on every rank: nothing walks it now
        generation._iter_named_params = lambda: iter(())
    client = getattr(generation, "vllm_client", None)
    if client is None:
        return  # not the main process, or not vLLM server mode: nothing syncs here
    if not hasattr(client, "step_of"):
        raise PluginLoadError(
            f"{type(client).__name__} is not wtcore's client: call wtcore_trl.install() before "
            "building the trainer"
        )
    client.step_of = lambda: int(trainer.state.global_step)
    if lora is not None:
        client.lora, client.model = lora, lora.name  # TRL's requests name client.model
