"""The multinode tests' name for :mod:`wtcore.netns` (namespaced nodes on one machine).

The harness became a production module when ``wtcore bench --nodes`` started using it
(production code never imports ``wtcore.testing``); this re-export keeps the tests' imports.
"""

from __future__ import annotations

from wtcore.netns import (
    CMD_TIMEOUT_S,
    DEFAULT_SUBNET,
    IFNAME,
    PREFIX,
    Cluster,
    NetnsError,
    Node,
    cluster,
    rate_bits,
    sweep_stale,
    unavailable_reason,
)

__all__ = [
    "CMD_TIMEOUT_S",
    "DEFAULT_SUBNET",
    "IFNAME",
    "PREFIX",
    "Cluster",
    "NetnsError",
    "Node",
    "cluster",
    "rate_bits",
    "sweep_stale",
    "unavailable_reason",
]
