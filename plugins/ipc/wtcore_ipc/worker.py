"""The worker half of ``ipc``: map the trainer's staging buffer and copy each tensor out once.

CPU: the trainer's sealed memfd is mapped once and kept across rounds; each tensor is copied
out of it into the tensor the sink offers. Slot headers and the segment are hostile input,
checked before anything is applied (docs/ipc.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

from wtcore.buckets import Bucket, as_bytes, unpack_bucket
from wtcore.errors import PayloadError, TransferError
from wtcore.sink import direct_destination
from wtcore_ipc.ring import chunks, wait_until
from wtcore_ipc.shm import (
    CANCELLED,
    CONTROL_BYTES,
    GAVE_UP,
    HEADER_BYTES,
    MAX_RECEIVERS,
    SegmentReader,
    SlotHeader,
    host_status,
    trainer_of,
)
from wtcore_ipc.wire import IPCInitInfo, IPCUpdateInfo
from wtcore_kit.bucketed import BucketedWorkerEngine

if TYPE_CHECKING:
    import torch

    from wtcore.meta import ParamMeta
    from wtcore_ipc.cuda import CudaImporter

__all__ = ["SHARED_COPY_THREADS", "IPCWorkerEngine", "copy_threads", "slot_ready"]

#: Most threads a worker copies shared weights with (docs/ipc.md); the ring keeps one, since
#: the trainer's packing holds a core there.
SHARED_COPY_THREADS = 2


def copy_threads(world_size: int) -> int:
    """Threads for one worker's copy of shared weights, ``world_size`` workers sharing the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(SHARED_COPY_THREADS, cores // max(1, world_size)))


class IPCWorkerEngine(BucketedWorkerEngine[IPCInitInfo, IPCUpdateInfo]):
    """Receives buckets through shared memory (CPU) or CUDA IPC (GPU)."""

    init_info_cls = IPCInitInfo
    update_info_cls = IPCUpdateInfo

    _reader: SegmentReader | None = None
    _importer: CudaImporter | None = None
    _aborted: threading.Event | None = None

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    def init_transfer_engine(self, init_info: IPCInitInfo) -> None:
        self._release()
        if init_info.transport == "cuda":
            import torch

            if not self.device.startswith("cuda") or not torch.cuda.is_available():
                raise PayloadError(
                    f"init_info.transport: 'cuda' needs a CUDA worker, this one is on "
                    f"{self.device!r} (cuda available: {torch.cuda.is_available()})"
                )
            from wtcore_ipc.cuda import CudaImporter

            self._importer = CudaImporter(self.device, init_info.packed_num_buffers)
        super().init_transfer_engine(init_info)

    def receives_after_return(self, update_info: IPCUpdateInfo) -> bool:
        """The ring's trainer waits for every worker's acknowledgements before its round
        ends; shared weights are the trainer's own (written again after the round), and a
        CUDA buffer is reused once its call returned."""
        return self.settings.transport == "shm" and update_info.offsets is None

    def receive_weights(self, update_info: IPCUpdateInfo) -> None:
        init = self.settings
        if init.transport == "shm":
            if update_info.segment is None:
                raise PayloadError("segment: required by the 'shm' transport negotiated at init")
            assert update_info.segment_fd is not None  # checked by IPCUpdateInfo
            r = self._mapped(update_info.segment, update_info.segment_fd)
            if update_info.offsets is not None:
                self._receive_shared(update_info, r, update_info.offsets)
            else:
                self._receive_ring(update_info, r)
        else:
            if update_info.cuda is None:
                raise PayloadError("cuda: required by the 'cuda' transport negotiated at init")
            self._receive_cuda(update_info, update_info.bucket(init))

    # ------------------------------------------------------------------ CPU
    def _segment(self, name: str, fd: int) -> SegmentReader:
        """The reader kept from earlier rounds (already faulted in), else a new one, checked."""
        r = self._reader
        if r is not None and not r.closed and (r.name, r.fd_number) == (name, fd):
            return r
        reader = SegmentReader(name, fd)  # PayloadError/TransferError naming what is wrong
        self._release()
        self._reader = reader
        return reader

    def _mapped(self, name: str, fd: int) -> SegmentReader:
        """The segment's reader, its size re-checked once per round."""
        r = self._segment(name, fd)
        try:
            r.check_size()
        except TransferError:
            self._release()
            raise
        return r

    def _receive_ring(self, u: IPCUpdateInfo, r: SegmentReader) -> None:
        assert u.num_slots is not None and u.slot_bytes is not None
        buckets = u.plan(self.settings)
        if self.rank >= MAX_RECEIVERS:
            raise PayloadError(f"rank: the ipc ring serves ranks below {MAX_RECEIVERS}")
        aborted = self._aborted = threading.Event()
        name = r.name
        stride = HEADER_BYTES + u.slot_bytes
        if CONTROL_BYTES + u.num_slots * stride != r.size:
            raise PayloadError(
                f"num_slots/slot_bytes: a ring of {u.num_slots} slots of {u.slot_bytes} bytes "
                f"takes {CONTROL_BYTES + u.num_slots * stride} bytes; segment {name!r} has "
                f"{r.size}"
            )
        self._check_owner(r)
        r.hold(self.rank)
        r.ack(self.rank, u.seq, 0, self.world_size)  # tells the trainer the world size
        try:
            self._consume_ring(u, r, buckets, aborted)
        except BaseException:
            # The trainer may wait for this rank's acknowledgements alone (a worker that
            # returned first, receives_after_return): tell it at once that none will come.
            with contextlib.suppress(TransferError):
                r.ack(self.rank, u.seq, GAVE_UP, self.world_size)
            raise

    def _consume_ring(
        self, u: IPCUpdateInfo, r: SegmentReader, buckets: list[Bucket], aborted: threading.Event
    ) -> None:
        import torch

        assert u.num_slots is not None and u.slot_bytes is not None
        name = r.name
        stride = HEADER_BYTES + u.slot_bytes
        f = 0  # chunks consumed
        loaded = False  # whether the sink has loaded a batch this round (_read_bucket)
        for bucket in buckets:
            pieces = chunks(bucket.nbytes, u.slot_bytes)
            # A bucket bigger than a slot (one tensor) is gathered into the sink's tensor or here.
            whole = dest = None
            if len(pieces) > 1:
                m = bucket.metas[0]
                dest = direct_destination(self.sink, m.name, m.dtype, m.shape, "cpu")
                whole = (
                    as_bytes(dest)
                    if dest is not None
                    else torch.empty(bucket.nbytes, dtype=torch.uint8)
                )
            for start, length in pieces:
                offset = CONTROL_BYTES + (f % u.num_slots) * stride + HEADER_BYTES
                seq = u.seq + f
                self._wait_slot(r, offset, seq, length, bucket, aborted)
                if whole is None:
                    loaded = self._read_bucket(r, offset, bucket, loaded)
                else:
                    r.read_into(offset, whole[start : start + length])
                if r.header(offset).seq != seq:
                    raise TransferError(
                        f"segment {name!r}: slot {f % u.num_slots} was overwritten while chunk "
                        f"seq={seq} was copied out of it; the loaded weights may be mixed"
                    )
                f += 1
                r.ack(self.rank, u.seq, f, self.world_size)
            if whole is not None and dest is None:
                self.sink.load_weights(list(unpack_bucket(bucket, whole)))
                loaded = True
            del whole, dest

    def _receive_shared(self, u: IPCUpdateInfo, r: SegmentReader, offsets: list[int]) -> None:
        """Copy each tensor straight out of the trainer's shared weights. The header carries
        this round's ``seq`` before and after the copy, or the round fails (stale or replayed
        before; after, the trainer gave up and may be changing its weights)."""
        self._check_owner(r)
        where = f"segment {r.name!r} of {trainer_of(r.name)}"
        base = CONTROL_BYTES + HEADER_BYTES
        head = r.header(base)
        if not head.valid or head.seq != u.seq:
            raise PayloadError(
                f"{where}: the shared weights are stamped seq={head.seq} (magic "
                f"{head.magic!r}); the update announces seq={u.seq}: stale, replayed or forged"
            )
        if head.length == CANCELLED or base + head.length > r.size:
            raise PayloadError(
                f"{where}: the shared weights' header claims {head.length} bytes; the segment "
                f"holds {r.size - base}"
            )
        for i, (m, off) in enumerate(zip(u.metas, offsets, strict=True)):
            if off + m.nbytes > head.length:
                raise PayloadError(
                    f"offsets[{i}]: {m.name!r} ({m.nbytes} bytes at {off}) ends past the "
                    f"{head.length} bytes of shared weights in {where}"
                )
        # Reads into the sink's own tensors are made together, on copy_threads(), but
        # always before the sink loads a later tensor: what lands, lands in the listed order.
        threads = copy_threads(self.world_size)
        direct: list[tuple[int, torch.Tensor]] = []
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        loaded = False
        for m, off in zip(u.metas, offsets, strict=True):
            staged = self._read_tensor(r, base + off, m, direct)
            if staged is None:
                continue
            group.append((m.name, staged))
            size += m.nbytes
            if size >= self.settings.packed_buffer_size_bytes or not loaded:
                r.read_many(direct, threads=threads)
                self.sink.load_weights(group)  # the first at once: see _read_bucket
                direct, group, size, loaded = [], [], 0, True
        r.read_many(direct, threads=threads)
        if group:
            self.sink.load_weights(group)
        del direct, group
        if r.header(base) != head or not r.owner_alive():
            self._check_owner(r)
            raise TransferError(
                f"{where}: the trainer abandoned round seq={u.seq} while it was copied out; "
                "the loaded weights may be mixed"
            )

    def _read_tensor(
        self,
        r: SegmentReader,
        at: int,
        m: ParamMeta,
        later: list[tuple[int, torch.Tensor]] | None = None,
    ) -> torch.Tensor | None:
        """Read tensor ``m`` at byte ``at``: into the tensor the sink offers (``None``; with
        ``later``, the read is left there for the caller), else into a fresh one, returned."""
        import torch

        dest = direct_destination(self.sink, m.name, m.dtype, m.shape, "cpu")
        if dest is not None and later is not None:
            later.append((at, as_bytes(dest)))
            return None
        out = dest if dest is not None else torch.empty(m.shape, dtype=m.dtype)
        r.read_into(at, as_bytes(out))
        return None if dest is not None else out

    def _read_bucket(self, r: SegmentReader, at: int, bucket: Bucket, loaded: bool) -> bool:
        """Read and load a packed bucket at byte ``at``; whether the sink has loaded a batch.

        Until it has, a tensor with no offered place is loaded alone at once: a sink (delta)
        may offer its tensors only once the round's first batch told it what kind of round
        this is, and the rest of the round is then read in place.
        """
        group = []
        for m, off in zip(bucket.metas, bucket.offsets, strict=True):
            staged = self._read_tensor(r, at + off, m)
            if staged is None:
                continue
            if not loaded:
                self.sink.load_weights([(m.name, staged)])
                loaded = True
                continue
            group.append((m.name, staged))
        if group:
            self.sink.load_weights(group)
        return loaded

    def _check_owner(self, r: SegmentReader) -> None:
        if not r.owner_alive():
            self._release()  # the last mapping of the orphan: the kernel frees it
            raise TransferError(
                f"segment {r.name!r}: the trainer process that owned it ({trainer_of(r.name)}) "
                "has exited; the round is abandoned and the orphaned segment was released"
            )

    def _wait_slot(
        self,
        r: SegmentReader,
        offset: int,
        seq: int,
        length: int,
        bucket: Bucket,
        aborted: threading.Event,
    ) -> None:
        """Wait (bounded) until the slot at ``offset`` holds chunk ``seq`` (:func:`slot_ready`)."""
        where = f"segment {r.name!r} of {trainer_of(r.name)}"

        def ready() -> bool:
            return slot_ready(r.header(offset), seq, length, where=where, bucket=bucket.index)

        def check() -> None:
            if aborted.is_set():
                raise TransferError(
                    f"{where}: the round was aborted while waiting for bucket {bucket.index}"
                )
            self._check_owner(r)

        wait_until(
            ready,
            timeout_s=self.settings.timeout_s,
            check=check,
            what=f"the trainer stamping bucket {bucket.index} (chunk seq={seq}) in {where}",
        )

    # ------------------------------------------------------------------ GPU (untested here)
    def _receive_cuda(self, u: IPCUpdateInfo, bucket: Bucket) -> None:
        assert self._importer is not None and u.cuda is not None
        assert u.offset is not None and u.length is not None
        shared = self._importer.view(u.cuda, u.offset, u.length)
        local = self._importer.clone(shared)
        del shared
        self.sink.load_weights(list(unpack_bucket(bucket, local)))

    # ------------------------------------------------------------------ lifetime
    def abort(self) -> None:
        """Stop waiting on the ring; drop the mapping if its trainer died (safe mid-copy: the
        reader's lock)."""
        if self._aborted is not None:
            self._aborted.set()
        reader = self._reader
        if reader is not None:
            reader.close_if_orphaned()

    def _release(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        if self._importer is not None:
            self._importer.close()
            self._importer = None

    def shutdown(self) -> None:
        self._release()
        super().shutdown()


def slot_ready(head: SlotHeader, seq: int, length: int, *, where: str, bucket: int) -> bool:
    """Whether a slot header holds chunk ``seq`` of ``length`` bytes (``False``: not yet);
    anything else raises. ``seq`` is the commit word: while it is below ``seq`` the magic and
    length beside it may be half-written, so only a header claiming this chunk or a later one
    is judged."""
    if head.seq < seq or head.blank:
        return False
    if not head.valid:
        raise PayloadError(
            f"{where}: the slot header for chunk seq={seq} has no valid magic "
            f"(got {head.magic!r}): forged or corrupt"
        )
    if head.seq > seq:
        raise PayloadError(
            f"{where}: the slot for bucket seq={seq} claims seq={head.seq}, "
            "a bucket the trainer cannot have stamped yet: forged or corrupt"
        )
    if head.length == CANCELLED:
        raise TransferError(f"{where}: the trainer abandoned the round before bucket {bucket}")
    if head.length != length:
        raise PayloadError(
            f"{where}: the slot header says chunk seq={seq} has {head.length} bytes; "
            f"the plan says {length}"
        )
    return True
