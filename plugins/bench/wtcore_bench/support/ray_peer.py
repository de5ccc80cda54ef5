"""``wtcore bench --client ray``: Ray actors as receivers (:class:`RayFleet`), and the
``ray_object_store`` peer, what a Ray user does instead: per bucket, ``ray.put`` a freshly packed
buffer and have every actor copy it into its model. Ray is started here unless connected.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from wtcore_bench.api import Baseline, BaselineContext, ClientBench

__all__ = [
    "BASELINES",
    "CLIENT",
    "ObjectStoreReceiver",
    "RayFleet",
    "object_store_gbps",
    "object_store_run",
    "start_ray",
]


def start_ray() -> bool:
    """Start a local Ray cluster unless one is connected; whether it was started here."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return True


def _stop_ray(started: bool) -> None:
    if started:
        import ray

        ray.shutdown()


def _zeros_sink(model: Any) -> Any:
    from wtcore.sink import ModuleSink

    return ModuleSink(model.build_zeros())


class RayFleet:
    def __init__(
        self,
        client_cls: type[Any],
        backend: str,
        count: int,
        model: Any,
        *,
        timeout_s: float,
        options: Mapping[str, Any],
    ) -> None:
        from wtcore_ray_client.launch import launch_receivers

        self._started = start_ray()
        on_gpu = str(model.device).startswith("cuda")
        try:
            self.group = launch_receivers(
                count,
                backend,
                functools.partial(_zeros_sink, model),
                device=model.device,
                num_cpus=0,
                num_gpus=1 / count if on_gpu else None,
                worker_options=dict(options),
                ready_timeout_s=timeout_s,
            )
            self.client = self.group.client(timeout_s=timeout_s)
        except BaseException:
            _stop_ray(self._started)
            raise

    def pids(self) -> list[int]:
        return [int(i["pid"]) for i in self.client.identities()]

    def close(self) -> None:
        try:
            self.group.shutdown()
        finally:
            _stop_ray(self._started)


class ObjectStoreReceiver:
    """A receiver actor's body: a zero model, filled from object-store buckets."""

    def __init__(self, metas: list[tuple[str, str, list[int]]]) -> None:
        from wtcore_bench.received import zeros_from_spec

        self.model = zeros_from_spec(metas)

    def receive(self, layout: list[tuple[str, int, int]], bucket: Any) -> int:
        import numpy as np

        from wtcore.buckets import as_bytes

        for name, offset, nbytes in layout:
            np.copyto(as_bytes(self.model[name]).numpy(), bucket[offset : offset + nbytes])
        return len(layout)

    def digests(self) -> dict[str, str]:
        from wtcore.digest import digest_named

        return digest_named(self.model.items())

    def raw(self) -> dict[str, bytes]:
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
    import ray
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
    started = start_ray()
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
        digests = ray.get([a.digests.remote() for a in actors], timeout=ctx.timeout_s)
        for rank, got in enumerate(digests):
            check_digests("ray_object_store peer", str(rank), want, got)
        models: list[dict[str, Any]] = []
        if send_models:
            raws = ray.get([a.raw.remote() for a in actors], timeout=ctx.timeout_s)
            models = [state_from_raw(raw, metas) for raw in raws]
        return gbps, models
    finally:
        for a in actors:
            ray.kill(a)
        _stop_ray(started)


def object_store_gbps(ctx: BaselineContext) -> float:
    return object_store_run(ctx)[0]


#: The peers of ``client.ray`` in ``wtcore.bench``.
BASELINES: dict[str, Baseline] = {
    "ray_object_store": Baseline("Ray object store (put, get, copy)", object_store_gbps, peer=True),
}

#: ``client.ray`` in ``wtcore.bench``.
CLIENT = ClientBench(RayFleet, BASELINES)
