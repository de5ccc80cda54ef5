"""Start N receiver actors with resource options, and always stop them (:class:`ReceiverFleet`).

:func:`launch_receivers` waits until every actor has built its sink, so a broken sink factory
fails here, naming the actor, instead of at the first update.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wtcore.engine import WeightTransferConfig
from wtcore.errors import PayloadError
from wtcore_kit.fanout import FAIL_FAST_S
from wtcore_ray_client.actor import SinkFactory, WeightSyncActor
from wtcore_ray_client.client import DEFAULT_TIMEOUT_S, RayWeightSyncClient, actor_label

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["ReceiverFleet", "launch_receivers"]


@dataclass
class ReceiverFleet:
    """Handles of launched receiver actors, their ranks, and how to stop them (a context
    manager)."""

    handles: list[ActorHandle[Any]]
    worker_ranks: list[int]
    #: Each actor's rank in the transfer group (``rank_offset + worker rank``).
    ranks: list[int]
    names: list[str | None]
    labels: list[str]
    _closed: bool = field(default=False, repr=False)

    def __len__(self) -> int:
        return len(self.handles)

    def client(
        self, *, timeout_s: float = DEFAULT_TIMEOUT_S, fail_fast_s: float | None = FAIL_FAST_S
    ) -> RayWeightSyncClient:
        return RayWeightSyncClient(
            self.handles, timeout_s=timeout_s, labels=self.labels, fail_fast_s=fail_fast_s
        )

    def shutdown(self, *, grace_s: float = 5.0) -> None:
        """Release each actor's data plane (best effort), kill it, and wait until it is gone."""
        if self._closed:
            return
        self._closed = True
        import ray

        refs: list[Any] = []
        for h in self.handles:
            with contextlib.suppress(Exception):
                refs.append(h.shutdown_weight_sync.remote())
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for h in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        _wait_dead(self.handles, timeout_s=max(grace_s, 10.0))

    def __enter__(self) -> ReceiverFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _wait_dead(handles: Sequence[Any], *, timeout_s: float) -> None:
    """Wait (bounded) until each killed actor refuses calls: ``ray.kill`` is asynchronous, and
    its resources (GPU, ports, shared memory) must be free for the next group."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    alive = list(handles)
    while alive and time.monotonic() < deadline:
        still = []
        for h in alive:
            try:
                ray.get(h.get_world_size.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except RayActorError:
                continue  # dead, as asked
            except GetTimeoutError:
                pass
            except Exception:
                continue  # cannot be reached at all: nothing more to wait for
            still.append(h)
        alive = still
        if alive:
            time.sleep(0.05)


def launch_receivers(
    num_actors: int,
    config: WeightTransferConfig | str | Mapping[str, Any],
    sink: SinkFactory,
    *,
    rank_offset: int = 1,
    device: str = "cpu",
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    resources: Mapping[str, float] | None = None,
    max_concurrency: int = 4,
    name_prefix: str | None = None,
    namespace: str | None = None,
    actor_cls: type[WeightSyncActor] = WeightSyncActor,
    actor_options: Mapping[str, Any] | None = None,
    per_actor_options: Sequence[Mapping[str, Any]] | None = None,
    ready_timeout_s: float = 120.0,
    worker_options: Mapping[str, Any] | None = None,
) -> ReceiverFleet:
    """Start ``num_actors`` receiver actors (worker ranks 0..n-1) and wait until they are up.

    ``sink`` builds the sink inside each actor. ``actor_options`` go to every actor's
    ``.options()``, ``per_actor_options[i]`` to actor ``i`` only (a node affinity); with
    ``name_prefix`` actor ``i`` is named ``f"{name_prefix}-{i}"`` (docs/ray.md).
    """
    import ray

    if not isinstance(num_actors, int) or num_actors < 1:
        raise PayloadError(f"num_actors: expected a positive int, got {num_actors!r}")
    if not isinstance(rank_offset, int) or rank_offset < 0:
        raise PayloadError(f"rank_offset: expected a non-negative int, got {rank_offset!r}")
    if per_actor_options is not None and len(per_actor_options) != num_actors:
        raise PayloadError(
            f"per_actor_options: expected one mapping per actor ({num_actors}), "
            f"got {len(per_actor_options)}"
        )
    base: dict[str, Any] = {"max_concurrency": max_concurrency, **(actor_options or {})}
    given = {"num_cpus": num_cpus, "num_gpus": num_gpus, "namespace": namespace}
    base.update((k, v) for k, v in given.items() if v is not None)
    if resources is not None:
        base["resources"] = dict(resources)
    remote_cls = ray.remote(actor_cls)
    group = ReceiverFleet([], [], [], [], [])
    try:
        for i in range(num_actors):
            opts = {**base, **(per_actor_options[i] if per_actor_options else {})}
            name = f"{name_prefix}-{i}" if name_prefix else opts.get("name")
            if name:
                opts["name"] = name
            label_hint = f"rank={rank_offset + i}" + (f" name={name}" if name else "")
            handle: Any = remote_cls.options(**opts).remote(  # type: ignore[attr-defined]
                config,
                sink,
                device=device,
                rank=i,
                world_size=num_actors,
                label=label_hint,
                **dict(worker_options or {}),
            )
            group.handles.append(handle)
            group.worker_ranks.append(i)
            group.ranks.append(rank_offset + i)
            group.names.append(name)
            group.labels.append(actor_label(handle, i, rank=rank_offset + i, name=name))
        group.client(timeout_s=ready_timeout_s).identities()  # surfaces constructor errors
    except BaseException:
        group.shutdown(grace_s=0)
        raise
    return group


def old_fleet_name(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``ReceiverGroup``, the old name of :class:`ReceiverFleet`,
    with a warning (until 0.3)."""

    def __getattr__(name: str) -> Any:
        if name == "ReceiverGroup":
            warnings.warn(
                f"{module}.ReceiverGroup is renamed ReceiverFleet; the old name will be "
                "removed in 0.3",
                DeprecationWarning,
                stacklevel=2,
            )
            return ReceiverFleet
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = old_fleet_name(__name__)
