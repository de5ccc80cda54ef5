"""What the release tests know about the distributions: where each lives, and how to read
its pyproject and readme."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[2]
URL = "https://github.com/wtcore/wtcore"

#: distribution name -> its directory, relative to the repository root.
DISTRIBUTIONS: dict[str, str] = {
    "wtcore": ".",
    "wtcore-nccl": "plugins/nccl",
    "wtcore-tcp": "plugins/tcp",
    "wtcore-channel": "plugins/channel",
    "wtcore-ipc": "plugins/ipc",
    "wtcore-http-client": "plugins/http_client",
    "wtcore-ray-client": "plugins/ray_client",
    "wtcore-vllm": "plugins/vllm",
    "wtcore-bench": "plugins/bench",
    "wtcore-delta": "plugins/delta",
    "wtcore-trl": "plugins/trl",
    "wtcore-mooncake": "plugins/mooncake",
}
PLUGINS = [name for name in DISTRIBUTIONS if name != "wtcore"]

#: Markdown link targets: inline ``[text](target)`` and reference ``[id]: target``.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)|^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", re.M)


def pyproject(dist: str) -> dict[str, Any]:
    with open(REPO / DISTRIBUTIONS[dist] / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def core_version() -> str:
    text = (REPO / "wtcore" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.M)
    assert match, "wtcore/_version.py: no __version__ line"
    return match.group(1)


def compatible_pin(version: str) -> str:
    """``wtcore~=X.Y.0``: any patch release of the core's minor series (0.x internals move)."""
    major, minor, *_ = version.split(".")
    return f"wtcore~={major}.{minor}.0"


def links(markdown: str) -> list[str]:
    return [a or b for a, b in _LINK.findall(markdown)]


def relative_links(markdown: str) -> list[str]:
    """Links a package index page cannot follow: anything not absolute http(s) or mailto."""
    return [t for t in links(markdown) if not re.match(r"(https?|mailto):", t)]
