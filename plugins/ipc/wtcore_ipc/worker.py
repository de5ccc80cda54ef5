"""The worker half of ``ipc``: map the trainer's staging buffer and copy each tensor out once.

CPU: the segment is mapped read-only once and kept across buckets and rounds; each tensor is
a view into it (:func:`wtcore.buckets.unpack_bucket`) that the sink copies into the model, so
every byte is copied exactly once on this side. Before anything is applied the worker checks
that the payload is one bucket of the advertised size (the shared rule), that it lies inside
the segment, that the slot header matches (magic, sequence number, length) and that the
trainer still holds the segment; a failed check is an error naming the field, with the model
untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from wtcore.buckets import Bucket, unpack_bucket
from wtcore.errors import PayloadError, TransferError
from wtcore.kit import BucketedWorkerEngine
from wtcore_ipc.shm import SegmentReader, host_status, reclaim_orphans
from wtcore_ipc.wire import IPCInitInfo, IPCUpdateInfo

if TYPE_CHECKING:
    from wtcore_ipc.cuda import CudaImporter

__all__ = ["IPCWorkerEngine"]


class IPCWorkerEngine(BucketedWorkerEngine[IPCInitInfo, IPCUpdateInfo]):
    """Receives buckets through shared memory (CPU) or CUDA IPC (GPU)."""

    init_info_cls = IPCInitInfo
    update_info_cls = IPCUpdateInfo
    renamed_init_fields: ClassVar[dict[str, str]] = {
        "buffer_size_bytes": "packed_buffer_size_bytes",
        "num_buffers": "packed_num_buffers",
    }

    _reader: SegmentReader | None = None
    _importer: CudaImporter | None = None

    @classmethod
    def host_status(cls) -> str:
        return host_status()

    def init_transfer_engine(self, init_info: IPCInitInfo) -> None:
        self._release()
        reclaim_orphans()  # segments of trainers killed before any worker mapped them
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

    def receive_weights(self, update_info: IPCUpdateInfo) -> None:
        init = self.settings
        bucket = update_info.bucket(init)
        if init.transport == "shm":
            if update_info.segment is None:
                raise PayloadError("segment: required by the 'shm' transport negotiated at init")
            self._receive_shm(update_info, bucket, update_info.segment)
        else:
            if update_info.cuda is None:
                raise PayloadError("cuda: required by the 'cuda' transport negotiated at init")
            self._receive_cuda(update_info, bucket)

    # ------------------------------------------------------------------ CPU
    def _segment(self, name: str) -> SegmentReader:
        if self._reader is not None and self._reader.name == name:
            return self._reader
        reader = SegmentReader(name)  # PayloadError if it does not exist
        self._release()
        self._reader = reader
        return reader

    def _receive_shm(self, u: IPCUpdateInfo, bucket: Bucket, name: str) -> None:
        r = self._segment(name)
        try:
            r.check_size()
        except TransferError:
            self._release()  # re-open (and re-check) on the next update
            raise
        if u.offset + u.length > r.size:
            raise PayloadError(
                f"offset/length: bytes [{u.offset}, {u.offset + u.length}) are outside segment "
                f"{name!r} of {r.size} bytes"
            )
        if not r.owner_alive():
            self._release()  # unlinks the orphan
            raise TransferError(
                f"segment {name!r}: the trainer process that owned it has exited; the round "
                "is abandoned and the orphaned segment was unlinked"
            )
        head = r.header(u.offset)
        if not head.valid:
            raise PayloadError(
                f"offset: no staging slot starts at byte {u.offset} of segment {name!r}"
            )
        if head.seq != u.seq or head.length != u.length:
            raise PayloadError(
                f"seq/length: the slot at offset {u.offset} holds bucket seq={head.seq} of "
                f"{head.length} bytes, the payload says seq={u.seq} of {u.length} bytes "
                "(a stale or replayed update?)"
            )
        views = list(unpack_bucket(bucket, r.view(u.offset, u.length)))
        try:
            self.sink.load_weights(views)
        finally:
            del views
        if r.header(u.offset).seq != u.seq:
            raise TransferError(
                f"segment {name!r}: the trainer overwrote slot {u.offset} while it was being "
                "copied; the loaded weights may be mixed"
            )

    # ------------------------------------------------------------------ GPU (untested here)
    def _receive_cuda(self, u: IPCUpdateInfo, bucket: Bucket) -> None:
        assert self._importer is not None and u.cuda is not None
        shared = self._importer.view(u.cuda, u.offset, u.length)
        local = self._importer.clone(shared)
        del shared
        self.sink.load_weights(list(unpack_bucket(bucket, local)))

    # ------------------------------------------------------------------ lifetime
    def abort(self) -> None:
        """An abandoned round: unlink the mapped segment if its trainer has exited.

        A live trainer keeps (and reuses) its segment; a killed one leaves it in ``/dev/shm``
        until someone unlinks it. Safe while a copy runs: the mapping stays valid.
        """
        reader = self._reader
        if reader is not None:
            reader.unlink_orphan()

    def _release(self) -> None:
        if self._reader is not None:
            self._reader.unlink_orphan()
            self._reader.close()
            self._reader = None
        if self._importer is not None:
            self._importer.close()
            self._importer = None

    def shutdown(self) -> None:
        self._release()
        super().shutdown()
