"""The Ray object-store peer for ``wtcore bench --baselines peers``: what a Ray user does instead.

Per bucket (the wtcore bucket rule, the nccl engine's default size), the trainer packs a fresh
buffer, ``ray.put`` s it, and hands the reference to every receiver actor, which ``ray.get`` s
it (Ray resolves the argument; a numpy array is read zero-copy from the object store) and
copies each tensor's bytes into its model. The round ends when every actor has answered.
Actors report digests after the last round, checked against the trainer's: a peer that
moved the wrong bytes is no yardstick.

The ``ray`` client's :class:`~wtcore_bench.api.ClientBench` (:data:`CLIENT`) carries them. The CPU
only: the object store is host memory. Ray is started for the measurement unless the process is
connected already (:class:`~wtcore_bench.support.ray.RaySession`).
"""

from __future__ import annotations

from typing import Any

from wtcore_bench.api import Baseline, BaselineContext, ClientBench
from wtcore_bench.support.ray import RayFleet, RaySession

__all__ = [
    "BASELINES",
    "CLIENT",
    "ObjectStoreReceiver",
    "object_store_gbps",
    "object_store_run",
]


class ObjectStoreReceiver:
    """A receiver actor's body: a zero model, filled from object-store buckets."""

    def __init__(self, metas: list[tuple[str, str, list[int]]]) -> None:
        from wtcore_bench.received import zeros_from_spec

        self.model = zeros_from_spec(metas)

    def receive(self, layout: list[tuple[str, int, int]], bucket: Any) -> int:
        """Copy ``(name, offset, nbytes)`` runs of ``bucket`` (a uint8 array) into the model."""
        import numpy as np

        from wtcore.buckets import as_bytes

        for name, offset, nbytes in layout:
            np.copyto(as_bytes(self.model[name]).numpy(), bucket[offset : offset + nbytes])
        return len(layout)

    def digests(self) -> dict[str, str]:
        from wtcore.digest import digest_named

        return digest_named(self.model.items())

    def raw(self) -> dict[str, bytes]:
        """Tests only: every tensor's bytes."""
        from wtcore_bench.received import raw_state

        return raw_state(self.model.items())


def object_store_run(
    ctx: BaselineContext,
    repeats: int = 2,
    *,
    bucket_bytes: int = 1 << 30,
    send_models: bool = False,
) -> tuple[float, list[dict[str, Any]]]:
    """GB/s through Ray's object store, and (with ``send_models``) every receiver's model."""
    from wtcore_bench.api import OptionalDependencyError

    try:
        import ray
    except ImportError as e:  # pragma: no cover - the plugin depends on ray
        raise OptionalDependencyError("the ray_object_store peer needs ray: pip install ray") from e
    import torch

    from wtcore.buckets import pack_bucket, plan_buckets
    from wtcore.digest import digest_named
    from wtcore.meta import ParamMeta
    from wtcore_bench.limits import median_gbps
    from wtcore_bench.received import check_digests, state_from_raw, state_spec

    metas = state_spec(ctx.state)
    tensors = list(ctx.state.values())
    buckets = plan_buckets([ParamMeta.of(n, t) for n, t in ctx.state.items()], bucket_bytes)
    layouts = [
        [(m.name, off, m.nbytes) for m, off in zip(b.metas, b.offsets, strict=True)]
        for b in buckets
    ]
    session = RaySession()
    session.start()
    actors: list[Any] = []
    try:
        remote = ray.remote(num_cpus=0)(ObjectStoreReceiver)
        actors = [remote.remote(metas) for _ in range(ctx.receivers)]
        ray.get([a.digests.remote() for a in actors], timeout=ctx.timeout_s)  # all up

        def run() -> None:
            pending = []
            first = 0
            for bucket, layout in zip(buckets, layouts, strict=True):
                part = tensors[first : first + len(bucket.metas)]
                first += len(bucket.metas)
                fresh = torch.empty(bucket.nbytes, dtype=torch.uint8)
                ref = ray.put(pack_bucket(bucket, part, fresh).numpy())
                pending += [a.receive.remote(layout, ref) for a in actors]
                del ref
            ray.get(pending, timeout=ctx.timeout_s)

        run()  # warm-up
        gbps = median_gbps(ctx.nbytes, run, repeats)
        want = digest_named(ctx.state.items())
        models: list[dict[str, Any]] = []
        digests = ray.get([a.digests.remote() for a in actors], timeout=ctx.timeout_s)
        for rank, got in enumerate(digests):
            check_digests("ray_object_store peer", str(rank), want, got)
        if send_models:
            raws = ray.get([a.raw.remote() for a in actors], timeout=ctx.timeout_s)
            models = [state_from_raw(raw, metas) for raw in raws]
        return gbps, models
    finally:
        for a in actors:
            ray.kill(a)
        session.stop()


def object_store_gbps(ctx: BaselineContext) -> float:
    """The ``ray_object_store`` peer: see :func:`object_store_run`."""
    return object_store_run(ctx)[0]


#: The peers of ``client.ray`` in ``wtcore.bench`` (:data:`CLIENT`).
BASELINES: dict[str, Baseline] = {
    "ray_object_store": Baseline("Ray object store (put, get, copy)", object_store_gbps, peer=True),
}

#: ``client.ray`` in ``wtcore.bench``: Ray actors as receivers, and the object-store peer.
CLIENT = ClientBench(RayFleet, BASELINES)
