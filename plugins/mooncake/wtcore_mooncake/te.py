"""The Mooncake Transfer Engine, loaded lazily: one place that imports it and says what is missing.

``mooncake.engine`` loads RDMA libraries (``libibverbs.so.1``) at import, even for its ``tcp``
protocol, so nothing imports it until an engine is built; ``wtcore plugins`` asks
:func:`host_status`, which says what to install instead of failing.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from typing import Any

from wtcore.errors import PluginLoadError, TransferError
from wtcore_mooncake.lending import Lender

__all__ = [
    "INSTALL_HINT",
    "PROGRESS_ENV",
    "bound_stalls",
    "close",
    "host_status",
    "lender",
    "load",
    "local_address",
    "start",
]

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (or the -cuda13, -efa, -rocm build, or "
    "mooncake-transfer-engine for CUDA 12), and the system library libibverbs.so.1 (Debian "
    "and Ubuntu: apt-get install libibverbs1)"
)


def load() -> Any:
    """Mooncake's ``TransferEngine`` class; :class:`PluginLoadError` saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise PluginLoadError(f"the mooncake engine needs Mooncake: {INSTALL_HINT} ({e})") from e
    return TransferEngine


def host_status() -> str:
    """One line for ``wtcore plugins``: whether Mooncake imports here, and if not, why."""
    try:
        load()
    except PluginLoadError as e:
        return f"unavailable: {e}"
    return "tcp ok; rdma where the host has HCAs"


_ENGINES: dict[tuple[str, str], tuple[Any, str]] = {}
_LENDERS: dict[tuple[str, str], Lender] = {}
_LOCK = threading.Lock()


def start(address: str, protocol: str) -> tuple[Any, str]:
    """This process's transfer engine on ``address``, and its ``host:port``: one per process,
    address and protocol, kept (stopping one takes a second); ``P2PHANDSHAKE``: no metadata
    server."""
    key = (address, protocol)
    with _LOCK:
        if key not in _ENGINES:
            engine = load()()
            rc = engine.initialize(address, "P2PHANDSHAKE", protocol, "")
            if rc != 0:
                raise TransferError(
                    f"Mooncake could not start a {protocol} transfer engine on {address} "
                    f"(status {rc})"
                )
            _ENGINES[key] = (engine, f"{address}:{engine.get_rpc_port()}")
        return _ENGINES[key]


def lender(address: str, protocol: str) -> Lender:
    """The :class:`~wtcore_mooncake.lending.Lender` of this process's transfer engine."""
    engine, _ = start(address, protocol)
    with _LOCK:
        return _LENDERS.setdefault((address, protocol), Lender(engine))


def close(address: str, protocol: str) -> None:
    """Close this process's transfer engine on ``address`` unless something else here holds it:
    the only way to end the reads peers still run against it (docs/mooncake.md); about a second,
    holding the GIL. What it had registered must stay alive until it is gone: its lender's
    loans here, the rest the caller's.
    """
    key = (address, protocol)
    with _LOCK:
        if key not in _ENGINES:
            return
        engine, held = _ENGINES[key][0], _LENDERS.get(key)
        # Its references: the table, the lender, this name and getrefcount's argument.
        if sys.getrefcount(engine) > 3 + (held is not None):
            return  # shared: it stays open; the lender keeps its loans as before
        del _ENGINES[key]
        _LENDERS.pop(key, None)
    loans = held.retire() if held is not None else []
    del held
    del engine  # the last reference: Mooncake stops its listener and closes every connection
    del loans  # only now may what it lent go


#: Mooncake's TCP transport fails a transfer that moved no byte for this many seconds (30).
PROGRESS_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
_progress_set: str | None = None  # the value bound_stalls last set


def bound_stalls(timeout_s: float) -> None:
    """Make this process's TCP transfers that stall for just over ``timeout_s`` fail inside
    Mooncake, which cannot cancel a read (docs/mooncake.md); just over, so that the worker's
    clearer timeout fires first. A value the user set stays; the last worker's init wins."""
    global _progress_set
    current = os.environ.get(PROGRESS_ENV)
    if current is not None and current != _progress_set:
        return  # the user's
    _progress_set = str(min(30, math.floor(timeout_s) + 1))
    if current != _progress_set:
        os.environ[PROGRESS_ENV] = _progress_set


def local_address(peer_host: str) -> str:
    """This host's address on the route to ``peer_host`` (a connected UDP socket sends nothing)."""
    if peer_host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return str(s.getsockname()[0])
