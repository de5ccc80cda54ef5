"""``ray``: a :class:`wtcore.WeightSyncClient` that fans every call out to Ray actors.

Each call is submitted to every actor at once and awaited through the core fan-out; a large
``update_weights`` payload is ``ray.put`` once for every actor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from wtcore.defaults import DEFAULT_TIMEOUT_S
from wtcore.errors import PayloadError, ReceiverFailure
from wtcore_kit.fanout import FAIL_FAST_S, FanOutClient, Target, receiver_args
from wtcore_ray_client._errors import failure_from_ray
from wtcore_ray_client._json import check_json_safe

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["DEFAULT_TIMEOUT_S", "RayWeightSyncClient", "actor_label"]

#: Extra time for ``ray.get`` itself, so that the fan-out's deadline fires first.
_GRACE_S = 2.0


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


class RayWeightSyncClient(FanOutClient):
    """Both client protocols over :class:`~wtcore_ray_client.WeightSyncActor` handles (or names
    of named actors, so a config file can build it). Once an actor has failed, the others get
    ``fail_fast_s`` more; ``close()`` leaves the actors running."""

    def __init__(
        self,
        handles: ActorHandle[Any] | str | Sequence[ActorHandle[Any] | str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str | None = None,
        labels: Sequence[str] | None = None,
        fail_fast_s: float | None = FAIL_FAST_S,
    ) -> None:
        import ray

        items: list[Any] = (
            list(handles) if isinstance(handles, (list, tuple)) else [handles]  # type: ignore[list-item]
        )
        if not items:
            raise PayloadError("handles: RayWeightSyncClient needs at least one actor")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise PayloadError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        self.handles: list[ActorHandle[Any]] = []
        default_labels: list[str] = []
        for i, h in enumerate(items):
            if isinstance(h, str):
                try:
                    handle = ray.get_actor(h, namespace=namespace)
                except ValueError as e:
                    raise PayloadError(
                        f"handles[{i}]: no Ray actor named {h!r} in namespace {namespace!r} ({e})"
                    ) from e
                default_labels.append(actor_label(handle, i, name=h))
            else:
                if not callable(getattr(h, "update_weights", None)) or not hasattr(
                    h.update_weights, "remote"
                ):
                    raise PayloadError(
                        f"handles[{i}]: expected a Ray actor handle of a WeightSyncActor or a "
                        f"named actor's name, got {type(h).__name__}"
                    )
                handle = h
                default_labels.append(actor_label(handle, i))
            self.handles.append(handle)
        if labels is not None and len(labels) != len(self.handles):
            raise PayloadError(
                f"labels: expected one per actor ({len(self.handles)}), got {len(labels)}"
            )
        self.labels = list(labels) if labels is not None else default_labels
        self.timeout_s = float(timeout_s)
        if fail_fast_s is not None and not (
            isinstance(fail_fast_s, (int, float)) and fail_fast_s >= 0
        ):
            raise PayloadError(f"fail_fast_s: expected None or a number >= 0, got {fail_fast_s!r}")
        self.fail_fast_s = None if fail_fast_s is None else float(fail_fast_s)

    def _targets(self, call: str, *args: Any, **kwargs: Any) -> list[Target[Any]]:
        """Submit ``call`` to every actor now; each target waits for its own answer."""
        out: list[Target[Any]] = []
        for i, (label, h) in enumerate(zip(self.labels, self.handles, strict=True)):
            try:
                ref, error = getattr(h, call).remote(*receiver_args(args, i), **kwargs), None
            except Exception as e:  # submission itself failed (no such method, Ray shut down)
                ref, error = None, e
            out.append((label, _RayCall(ref, error, self.timeout_s + _GRACE_S)))
        return out

    def _describe(self, label: str, error: BaseException) -> ReceiverFailure:
        return failure_from_ray(label, error)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        check_json_safe(init_info, "init_info")
        super().init_weight_transfer_engine(init_info)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        import ray

        check_json_safe(update_info, "update_info")
        if isinstance(update_info, list):  # each actor gets only its own entry
            super().update_weights(update_info)
            return
        # One copy in the object store, shared by every actor (Ray resolves top-level refs).
        payload = ray.put(update_info) if len(self.handles) > 1 else update_info
        self._each("update_weights", payload, round_id=self.round_id)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None and not isinstance(weight_version, str):
            raise PayloadError(f"weight_version: expected a string or None, got {weight_version!r}")
        super().finish_weight_update(weight_version)

    def identities(self) -> list[dict[str, Any]]:
        return self._each("identity")

    def get_world_size(self) -> int:
        return len(self.handles)


class _RayCall:
    """One submitted actor call; ``cancel()`` drops it if still queued, never interrupting a
    running call (the actor's state machine stays whole)."""

    def __init__(self, ref: Any, error: BaseException | None, timeout_s: float) -> None:
        self.ref = ref
        self.error = error
        self.timeout_s = timeout_s

    def __call__(self) -> Any:
        import ray

        if self.error is not None:
            raise self.error
        return ray.get(self.ref, timeout=self.timeout_s)

    def cancel(self) -> None:
        import ray

        if self.ref is not None:
            ray.cancel(self.ref)
