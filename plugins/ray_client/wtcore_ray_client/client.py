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

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

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
    each actor (:func:`launch_receivers` passes rank and name). ``timeout_s`` bounds each
    call; once an actor has failed, the others get ``fail_fast_s`` more (``None``: the full
    timeout) before they are reported as still running.
    """

    def __init__(
        self,
        handles: ActorHandle[Any] | str | Sequence[ActorHandle[Any] | str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str | None = None,
        labels: Sequence[str] | None = None,
        fail_fast_s: float | None = 5.0,
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
        if fail_fast_s is not None and not (
            isinstance(fail_fast_s, (int, float)) and fail_fast_s >= 0
        ):
            raise ValueError(f"fail_fast_s: expected None or a number >= 0, got {fail_fast_s!r}")
        self.fail_fast_s = None if fail_fast_s is None else float(fail_fast_s)

    # ------------------------------------------------------------------ fan-out
    def _each(self, call: str, *args: Any) -> list[Any]:
        """Call ``call`` on every actor; return results in order or raise ReceiverError.

        Once one actor has failed, the others get ``fail_fast_s`` more to answer rather than
        the whole timeout: with a collective engine, a peer that rejected ``init`` or died
        leaves the rest blocked until their own data-plane timeout, and the trainer should
        hear about the real cause now.
        """
        import ray

        deadline = time.monotonic() + self.timeout_s
        cut_short = False
        index: dict[Any, int] = {}
        results: dict[int, Any] = {}
        failures: dict[int, ReceiverFailure] = {}
        for i, h in enumerate(self.handles):
            try:
                index[getattr(h, call).remote(*args)] = i
            except Exception as e:  # submission itself failed (no such method, Ray shut down)
                failures[i] = failure_from_ray(self.labels[i], e)
        if failures and self.fail_fast_s is not None:
            deadline, cut_short = min(deadline, time.monotonic() + self.fail_fast_s), True
        remaining = list(index)
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=left)
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref, timeout=10.0)  # ready: no real wait
                except Exception as e:
                    failures[i] = failure_from_ray(self.labels[i], e)
                    if self.fail_fast_s is not None and not cut_short:
                        deadline = min(deadline, time.monotonic() + self.fail_fast_s)
                        cut_short = True
        for ref in remaining:
            i = index[ref]
            why = (
                f"still running {self.fail_fast_s:g} s after another actor failed"
                if cut_short
                else f"no answer within {self.timeout_s:g} s"
            )
            failures[i] = ReceiverFailure(
                self.labels[i],
                f"{why} (the call may still be running in the actor)",
                error_type="TransferTimeoutError",
            )
            with contextlib.suppress(Exception):  # drops it if queued; never interrupts it
                ray.cancel(ref)
        if failures:
            raise ReceiverError(
                call, [failures[i] for i in sorted(failures)], total=len(self.handles)
            )
        return [results[i] for i in range(len(self.handles))]

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

    bench_launcher: ClassVar[str] = "wtcore_ray_client.bench:RayFleet"  # wtcore bench
