"""The worker half of ``mooncake``: read each announced bucket, then load it.

Each ``update_weights`` names a slot of the trainer's registered staging and the bucket's
length. Before a byte moves the worker checks them against what the init announced and what
the metadata plans (one bucket, exactly its bytes, inside the slot and inside this worker's own
staging); then one ``transfer_sync_read`` brings the bucket into this worker's registered
staging, bounded by ``timeout_s``, and the sink loads it. A read that fails or stalls fails the
round naming the trainer's endpoint; the staging is then unregistered (the next init registers
it again), unless the read may still be writing into it, in which case it is kept until it ends.
"""

from __future__ import annotations

from typing import Any

from wtcore.bucketed import BucketedWorkerEngine
from wtcore.buckets import plan_round, unpack_bucket
from wtcore.concurrency import BackgroundCall
from wtcore.errors import PayloadError, TransferError, TransferTimeoutError
from wtcore_mooncake import te
from wtcore_mooncake.wire import MooncakeInitInfo, MooncakeUpdateInfo

__all__ = ["MooncakeWorkerEngine"]


class MooncakeWorkerEngine(BucketedWorkerEngine[MooncakeInitInfo, MooncakeUpdateInfo]):
    """Pulls buckets from the trainer's registered staging (see the module docstring)."""

    init_info_cls = MooncakeInitInfo
    update_info_cls = MooncakeUpdateInfo

    _engine: Any = None
    _staging: Any = None  # a flat uint8 tensor, registered while set
    #: Reads that outlived their timeout, each with the staging it may still write into (kept
    #: alive, and registered, until the read ends: freeing it would let Mooncake write freed
    #: memory, and a later buffer at the same address could not be registered).
    _reading: list[tuple[BackgroundCall[Any], Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading = []

    @classmethod
    def host_status(cls) -> str:
        return te.host_status()

    def init_transfer_engine(self, init_info: MooncakeInitInfo) -> None:
        import torch

        self._release()
        if self._engine is None:
            self._engine, _ = te.start(te.local_address(init_info.host), init_info.protocol)
        size = max(n for _, n in init_info.slots)
        staging = torch.empty(size, dtype=torch.uint8, device="cpu")
        rc = self._engine.register_memory(staging.data_ptr(), size)
        if rc != 0:
            raise TransferError(
                f"Mooncake could not register {size} bytes of staging (status {rc})"
            )
        self._staging = staging
        super().init_transfer_engine(init_info)

    def receive_weights(self, update_info: MooncakeUpdateInfo) -> None:
        init = self.settings
        buckets = plan_round(
            update_info.metas, packed=init.packed, buffer_size_bytes=init.packed_buffer_size_bytes
        )
        expected = buckets[0].nbytes if buckets else 0
        if len(buckets) > 1 or update_info.nbytes != expected:
            raise PayloadError(
                f"update_info.nbytes: {update_info.nbytes} bytes announced, the listed tensors "
                f"are {len(buckets)} bucket(s) of {expected} bytes"
            )
        if update_info.slot >= len(init.slots):
            raise PayloadError(
                f"update_info.slot: {update_info.slot}, the init announced {len(init.slots)}"
            )
        remote, capacity = init.slots[update_info.slot]
        staging = self._staging
        if staging is None:
            raise TransferError(
                "mooncake: the staging was released after a failed read; init again"
            )
        if expected > capacity or expected > staging.numel():
            raise PayloadError(
                f"update_info.nbytes: {expected} bytes do not fit slot {update_info.slot} "
                f"({capacity} bytes) or this worker's staging ({staging.numel()} bytes)"
            )
        if not buckets:
            return
        if expected:
            self._read(init, staging, remote, expected)
        self.sink.load_weights(list(unpack_bucket(buckets[0], staging[:expected])))

    def _read(self, init: MooncakeInitInfo, staging: Any, remote: int, n: int) -> None:
        call = BackgroundCall(
            self._engine.transfer_sync_read,
            init.endpoint,
            staging.data_ptr(),
            remote,
            n,
            name="mooncake-read",
        )
        if not call.wait(init.timeout_s):
            self._reading.append((call, staging))  # kept alive for the read
            self._staging = None
            raise TransferTimeoutError(
                f"reading {n} bytes from the trainer at {init.endpoint} took over "
                f"{init.timeout_s:g} s; the round is failed"
            )
        rc = call.result(0)
        if rc != 0:
            self._release()
            raise TransferError(
                f"reading {n} bytes from the trainer at {init.endpoint} failed (Mooncake "
                f"status {rc}: the trainer is gone, or the region is not registered there)"
            )

    def _release(self) -> None:
        """Unregister the staging; a timed-out read's staging only once that read has ended."""
        ended = [r[0].wait(0) for r in self._reading]
        for (_, stale), done in zip(self._reading, ended, strict=True):
            if done:
                self._engine.unregister_memory(stale.data_ptr())
        self._reading = [r for r, done in zip(self._reading, ended, strict=True) if not done]
        staging, self._staging = self._staging, None
        if staging is not None and self._engine is not None:
            self._engine.unregister_memory(staging.data_ptr())

    def shutdown(self) -> None:
        self._release()  # the transfer engine is the process's (te.start), and stays
        super().shutdown()
