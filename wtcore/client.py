"""The control-plane protocols every client (in-process, HTTP, Ray) implements.

:class:`WeightSyncClient` is the four calls of vLLM's RL API, all a trainer engine needs to run
a round. :class:`InspectableClient` adds what tools around a round use (``send_weights(
verify=True)``, ``wtcore bench``, operators): each receiver's state and checksums, a
best-effort abort, the world size and ``close``. Both are runtime-checkable, so
``isinstance(client, InspectableClient)`` is how the core asks whether a client can inspect.
Every inspection call has ONE return shape for every transport: a list with one entry per
receiver, in the client's receiver order (see docs/protocol.md).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["InspectableClient", "WeightSyncClient", "calls_of"]


@runtime_checkable
class WeightSyncClient(Protocol):
    """Blocking calls that reach every receiver and raise on any failure (docs/protocol.md).

    ``update_info`` is one dict for all receivers, or a list with one entry per worker rank.
    A :class:`~wtcore.worker.WeightSyncWorker` satisfies this protocol itself.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@runtime_checkable
class InspectableClient(WeightSyncClient, Protocol):
    """A :class:`WeightSyncClient` that can also inspect and manage its receivers.

    Implemented by :class:`~wtcore_kit.inproc.InProcessClient`, the HTTP and the Ray clients (all
    through :class:`~wtcore_kit.fanout.FanOutClient`). A bare
    :class:`~wtcore.worker.WeightSyncWorker` is *not* one: wrap it in ``InProcessClient`` to
    inspect it. Every call reaches every receiver and raises one
    :class:`~wtcore.errors.ReceiverError` naming each that failed.
    """

    def weight_info(self) -> list[dict[str, Any]]:
        """Each receiver's state (``weight_version``, ``consistent``, ``state``, ...)."""
        ...

    def checksums(self) -> list[dict[str, str]]:
        """Each receiver's ``{name: digest}`` of the weights it holds (:mod:`wtcore.digest`)."""
        ...

    def abort_weight_update(self, reason: str = "aborted by the trainer") -> None:
        """End an open round without publishing, where the receiver supports it.

        Best effort: a receiver that cannot abort is left alone, and the next
        ``init_weight_transfer_engine`` abandons any open round anyway.
        """
        ...

    def get_world_size(self) -> int:
        """The inference world size: how many worker ranks an ``update_info`` list covers."""
        ...

    def close(self) -> None:
        """Release the client's own resources (connections); the receivers keep running."""
        ...


def calls_of(protocol: type) -> tuple[str, ...]:
    """The public calls ``protocol`` declares, its bases' first, in declaration order.

    The one list of names for anything that must answer or check a protocol's calls (a test
    control plane, the bench's client check), so none of them spells the calls out again.
    """
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls.__module__ == __name__:
            names.update((n, None) for n, v in vars(cls).items() if callable(v) and n[0] != "_")
    return tuple(names)
