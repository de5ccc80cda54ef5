"""``ray``: a :class:`wtcore.WeightSyncClient` that fans every call out to Ray actors.

Each call is submitted to every actor at once and awaited with ``ray.wait`` under one
deadline, so N replicas cost one round trip and a dead or stuck one costs one timeout. All
failures come back in one :class:`wtcore.ReceiverError` (the core's format, shared with the
HTTP and in-process clients) naming each failing actor: its label carries the rank and actor
name where known, and always the actor id.

Payloads are checked to be plain JSON (:mod:`wtcore_ray_client._json`): Ray never carries a
pickled tensor or handle here, so the same trainer code works over HTTP. A large
``update_weights`` payload is ``ray.put`` once and shared by every actor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, ReceiverError, ReceiverFailure
from wtcore_ray_client._errors import failure_from_ray
from wtcore_ray_client._json import check_json_safe

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["DEFAULT_TIMEOUT_S", "RayWeightSyncClient", "actor_label"]

#: Generous: ``init_weight_transfer_engine`` may wait for a rendezvous across nodes.
DEFAULT_TIMEOUT_S = 300.0


def actor_label(
    handle: Any, index: int, *, rank: int | None = None, name: str | None = None
) -> str:
    """``actor[rank=1 name=recv-1 id=3f2a...]``: what a failure message calls this actor."""
    parts = [f"rank={rank}" if rank is not None else f"#{index}"]
    if name:
        parts.append(f"name={name}")
    actor_id = getattr(handle, "_actor_id", None)
    if actor_id is not None:
        parts.append(f"id={actor_id.hex()}")
    return f"actor[{' '.join(parts)}]"


class RayWeightSyncClient:
    """Fan-out client over :class:`~wtcore_ray_client.WeightSyncActor` handles.

    ``handles`` are actor handles, or names of named actors (looked up in ``namespace``), so
    the client can also be built from a config file. ``labels`` overrides how failures name
    each actor (:func:`launch_receivers` passes rank and name).
    """

    def __init__(
        self,
        handles: ActorHandle[Any] | str | Sequence[ActorHandle[Any] | str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str | None = None,
        labels: Sequence[str] | None = None,
    ) -> None:
        import ray

        items: list[Any] = (
            list(handles) if isinstance(handles, (list, tuple)) else [handles]  # type: ignore[list-item]
        )
        if not items:
            raise ValueError("handles: RayWeightSyncClient needs at least one actor")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        self.handles: list[ActorHandle[Any]] = []
        default_labels: list[str] = []
        for i, h in enumerate(items):
            if isinstance(h, str):
                try:
                    handle = ray.get_actor(h, namespace=namespace)
                except ValueError as e:
                    raise ValueError(
                        f"handles[{i}]: no Ray actor named {h!r} in namespace {namespace!r} ({e})"
                    ) from e
                default_labels.append(actor_label(handle, i, name=h))
            else:
                if not callable(getattr(h, "update_weights", None)) or not hasattr(
                    h.update_weights, "remote"
                ):
                    raise TypeError(
                        f"handles[{i}]: expected a Ray actor handle of a WeightSyncActor or a "
                        f"named actor's name, got {type(h).__name__}"
                    )
                handle = h
                default_labels.append(actor_label(handle, i))
            self.handles.append(handle)
        if labels is not None and len(labels) != len(self.handles):
            raise ValueError(
                f"labels: expected one per actor ({len(self.handles)}), got {len(labels)}"
            )
        self.labels = list(labels) if labels is not None else default_labels
        self.timeout_s = float(timeout_s)

    # ------------------------------------------------------------------ fan-out
    def _each(self, call: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call ``call`` on every actor; return results in order or raise ReceiverError."""
        import ray
        from ray.exceptions import GetTimeoutError

        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        refs = []
        failures: dict[int, ReceiverFailure] = {}
        for i, h in enumerate(self.handles):
            try:
                refs.append(getattr(h, call).remote(*args))
            except Exception as e:  # submission itself failed (e.g. Ray shut down)
                refs.append(None)
                failures[i] = failure_from_ray(self.labels[i], e)
        pending = [r for r in refs if r is not None]
        ready, _ = (
            ray.wait(pending, num_returns=len(pending), timeout=timeout) if pending else ([], [])
        )
        ready_set = set(ready)
        results: list[Any] = []
        for i, ref in enumerate(refs):
            if ref is None:
                continue
            if ref not in ready_set:
                failures[i] = ReceiverFailure(
                    self.labels[i],
                    f"no answer within {timeout:g} s (the call may still be running in the actor)",
                    error_type="TransferTimeoutError",
                )
                try:  # drop it if still queued; a running actor task is never interrupted
                    ray.cancel(ref)
                except Exception:
                    pass
                continue
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic()) + 1.0))
            except GetTimeoutError:
                failures[i] = ReceiverFailure(
                    self.labels[i],
                    f"no answer within {timeout:g} s",
                    error_type="TransferTimeoutError",
                )
            except Exception as e:
                failures[i] = failure_from_ray(self.labels[i], e)
        if failures:
            raise ReceiverError(call, [failures[i] for i in sorted(failures)], total=len(refs))
        return results

    # ------------------------------------------------------------------ the protocol
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        check_json_safe(init_info, "init_info")
        self._each("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        import ray

        check_json_safe(update_info, "update_info")
        if isinstance(update_info, list) and len(update_info) != len(self.handles):
            raise PayloadError(
                f"update_info: a list must hold one entry per actor, expected "
                f"{len(self.handles)}, got {len(update_info)}"
            )
        # One copy in the object store, shared by every actor (Ray resolves top-level refs).
        self._each("update_weights", ray.put(update_info) if len(self.handles) > 1 else update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None and not isinstance(weight_version, str):
            raise PayloadError(f"weight_version: expected a string or None, got {weight_version!r}")
        self._each("finish_weight_update", weight_version)

    # ------------------------------------------------------------------ beyond the protocol
    def abort_weight_update(self, reason: str = "aborted by the trainer") -> None:
        """End an open round on every actor without publishing a version."""
        self._each("abort_weight_update", reason)

    def weight_info(self) -> list[dict[str, Any]]:
        """Each actor's ``weight_info()``, in handle order; raises if any actor fails."""
        return self._each("weight_info")

    def checksums(self) -> list[dict[str, str]]:
        """Each actor's ``{name: digest}``, in handle order."""
        return self._each("checksums")

    def identities(self) -> list[dict[str, Any]]:
        """Each actor's rank, actor id, name, node IP and pid."""
        return self._each("identity")

    def get_world_size(self) -> int:
        """The number of inference workers this client reaches."""
        return len(self.handles)
