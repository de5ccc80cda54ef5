"""CUDA IPC handles as plain JSON (GPU path; NOT yet run on a GPU, see docs/ipc.md).

Each buffer is exported once and imported once (cached), so torch's IPC reference counters
balance; the GPU is found by UUID, since indices differ with ``CUDA_VISIBLE_DEVICES``. The
worker clones each bucket before returning, so the trainer may then overwrite the buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pybase64

from wtcore.errors import PayloadError, TransferError

if TYPE_CHECKING:
    import torch

__all__ = ["CudaImporter", "CudaStaging", "device_uuid", "index_of_uuid"]

_KEYS = (
    "gpu_uuid",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def index_of_uuid(uuid: str) -> int:
    """This process's index of the physical GPU ``uuid``."""
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise PayloadError(f"cuda.gpu_uuid: GPU {uuid!r} is not visible to this worker")


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else pybase64.b64encode(raw).decode("ascii")


def _unb64(field: str, text: object) -> bytes | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise PayloadError(f"cuda.{field}: expected a base64 string, got {type(text).__name__}")
    try:
        return pybase64.b64decode(text, validate=True)
    except ValueError as e:
        raise PayloadError(f"cuda.{field}: not valid base64 ({e})") from e


class CudaStaging:
    """``num_slots`` staging buffers on one GPU, each exported once as JSON."""

    def __init__(self, capacity: int, num_slots: int, device: str) -> None:
        import torch

        self.device = torch.device(device)
        self.capacity = max(capacity, 1)
        self.slots = [
            torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
            for _ in range(num_slots)
        ]
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = device_uuid(index)
        self.handles: list[dict[str, Any]] = []
        for buf in self.slots:
            (
                _dev,
                handle,
                size,
                offset,
                rc_handle,
                rc_offset,
                ev_handle,
                ev_sync,
            ) = buf.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            self.handles.append(
                {
                    "gpu_uuid": uuid,
                    "handle": _b64(handle),
                    "storage_size_bytes": int(size),
                    "storage_offset_bytes": int(offset),
                    "ref_counter_handle": _b64(rc_handle),
                    "ref_counter_offset": int(rc_offset),
                    "event_handle": _b64(ev_handle),
                    "event_sync_required": bool(ev_sync),
                }
            )

    def slot(self, i: int) -> torch.Tensor:
        return self.slots[i]

    def publish(self, i: int) -> None:
        """Make the packed bytes visible to other processes before the call goes out."""
        import torch

        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.slots = []
        self.handles = []


class CudaImporter:
    """The worker side: one import per exported buffer, cached until the handle changes."""

    def __init__(self, device: str, max_imports: int) -> None:
        self.device = device
        self.max_imports = max(1, max_imports)
        self._cache: dict[str, torch.Tensor] = {}

    def view(self, spec: dict[str, Any], offset: int, length: int) -> torch.Tensor:
        import torch

        missing = [k for k in _KEYS if k not in spec]
        if missing:
            raise PayloadError(f"cuda: missing key(s) {', '.join(missing)}")
        uuid = spec["gpu_uuid"]
        if not isinstance(uuid, str):
            raise PayloadError(f"cuda.gpu_uuid: expected a string, got {uuid!r}")
        handle = _unb64("handle", spec["handle"])
        if handle is None:
            raise PayloadError("cuda.handle: expected a base64 string, got null")
        size = spec["storage_size_bytes"]
        if not isinstance(size, int) or offset + length > size:
            raise PayloadError(
                f"offset/length: [{offset}, {offset + length}) is outside the exported buffer "
                f"of {size!r} bytes"
            )
        hit = self._cache.get(spec["handle"])
        if hit is None:
            index = index_of_uuid(uuid)
            torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
            with torch.cuda.device(index):
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    handle,
                    size,
                    spec["storage_offset_bytes"],
                    _unb64("ref_counter_handle", spec["ref_counter_handle"]),
                    spec["ref_counter_offset"],
                    _unb64("event_handle", spec["event_handle"]),
                    spec["event_sync_required"],
                )
            hit = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(
                storage, 0, (size,), (1,)
            )
            while len(self._cache) >= self.max_imports:  # the trainer re-exported: drop the
                self._cache.pop(next(iter(self._cache)))  # oldest import (frees its mapping)
            self._cache[spec["handle"]] = hit
        return hit[offset : offset + length]

    def clone(self, view: torch.Tensor) -> torch.Tensor:
        import torch

        try:
            out = view.to(self.device, copy=True)
            torch.cuda.synchronize(out.device)
        except RuntimeError as e:
            raise TransferError(f"cuda: copying out of the shared buffer failed: {e}") from e
        return out

    def close(self) -> None:
        self._cache.clear()
