"""The control-plane protocols every client implements; ``isinstance(client,
InspectableClient)`` is how the core asks whether a client can inspect."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["InspectableClient", "WeightSyncClient", "calls_of", "inspectable"]


@runtime_checkable
class WeightSyncClient(Protocol):
    """vLLM's four RL calls, reaching every receiver and raising on any failure.
    ``update_info`` is one dict for all, or a list with one entry per worker rank."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@runtime_checkable
class InspectableClient(WeightSyncClient, Protocol):
    """A :class:`WeightSyncClient` that can also inspect and manage its receivers; each call
    returns one entry per receiver, in order."""

    def weight_info(self) -> list[dict[str, Any]]:
        """Each receiver's state (``weight_version``, ``consistent``, ``state``, ...)."""
        ...

    def checksums(self) -> list[dict[str, str]]:
        """Each receiver's ``{name: digest}`` of the weights it holds (:mod:`wtcore.digest`)."""
        ...

    def abort_weight_update(self, reason: str = "aborted by the trainer") -> None:
        """End an open round without publishing; best effort (the next init abandons it too)."""
        ...

    def get_world_size(self) -> int:
        """The inference world size: how many worker ranks an ``update_info`` list covers."""
        ...

    def close(self) -> None:
        """Release the client's own resources; the receivers keep running."""
        ...


def calls_of(protocol: type) -> tuple[str, ...]:
    """The public calls ``protocol`` declares, its bases' first, in declaration order (so
    nothing that answers or checks them spells them out again)."""
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls.__module__ == __name__:
            names.update((n, None) for n, v in vars(cls).items() if callable(v) and n[0] != "_")
    return tuple(names)


def inspectable(client: object) -> InspectableClient | None:
    """``client`` as an :class:`InspectableClient`, else the one it wraps (``inner``), else None.

    The trainer's wrappers (round ids, verification) forward by ``__getattr__``, which a
    protocol's ``isinstance`` does not see from Python 3.12 on.
    """
    for _ in range(8):  # wrappers nest a few deep at most
        if client is None or isinstance(client, InspectableClient):
            return client
        client = getattr(client, "inner", None)
    return None
