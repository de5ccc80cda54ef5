"""Where vLLM keeps its weight-transfer package, which newer releases move (docs/vllm.md): every
import goes through :func:`weight_transfer`, so a vLLM with neither path fails naming both."""

from __future__ import annotations

import importlib
from types import ModuleType

from wtcore.errors import PluginLoadError

__all__ = ["PACKAGES", "weight_transfer"]

#: The package's paths, newest first.
PACKAGES = ("vllm.backends.distributed.weight_transfer", "vllm.distributed.weight_transfer")


def weight_transfer(module: str) -> ModuleType:
    """``<package>.<module>`` (``"base"``, ``"factory"``) from the first path vLLM has."""
    for package in PACKAGES:
        target = f"{package}.{module}"
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is None or not (target == e.name or target.startswith(e.name + ".")):
                raise  # the module exists but failed to import something else: say so
    raise PluginLoadError(
        f"this vLLM has no weight-transfer module {module!r} at any known path "
        f"({', '.join(f'{p}.{module}' for p in PACKAGES)}); wtcore-vllm supports vLLM 0.32 "
        "and later"
    )
