"""What a baseline's receivers hold, checked against what was sent.

A baseline that measures someone else's way of moving weights (a peer) is a yardstick only if
it moved them exactly, so its receivers report digests after the last round and the sender
checks them here. Tests also fetch the bytes themselves (:func:`raw_state`,
:func:`state_from_raw`: plain bytes with the spec beside them, never a pickled tensor) and
compare them with ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from wtcore.errors import TransferError

if TYPE_CHECKING:
    import torch

__all__ = ["Spec", "check_digests", "raw_state", "state_from_raw", "state_spec", "zeros_from_spec"]

#: ``[(name, dtype name, shape)]``: enough to rebuild zeros or decode raw bytes.
Spec = list[tuple[str, str, list[int]]]


def state_spec(state: Mapping[str, torch.Tensor]) -> Spec:
    from wtcore.meta import dtype_name

    return [(n, dtype_name(t.dtype), list(t.shape)) for n, t in state.items()]


def zeros_from_spec(spec: Spec, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A receiver's model before its first round: zeros of every tensor ``spec`` names."""
    import torch

    from wtcore.meta import dtype_from_name

    return {n: torch.zeros(s, dtype=dtype_from_name(d), device=device) for n, d, s in spec}


def check_digests(
    label: str, receiver: str, want: Mapping[str, str], got: Mapping[str, str]
) -> None:
    """A :class:`~wtcore.errors.TransferError` naming ``receiver`` unless ``got == want``."""
    bad = sorted(n for n, d in want.items() if got.get(n) != d)
    if bad:
        raise TransferError(
            f"{label}: receiver {receiver} holds different bytes for {len(bad)} tensor(s), "
            f"first {bad[0]!r}"
        )


def raw_state(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    """Every tensor's bytes (any device)."""
    from wtcore.buckets import as_bytes

    return {n: bytes(as_bytes(t.detach().cpu().contiguous()).numpy()) for n, t in items}


def state_from_raw(raw: Mapping[str, bytes], spec: Spec) -> dict[str, torch.Tensor]:
    """The tensors :func:`raw_state` encoded, rebuilt from ``spec``."""
    import torch

    from wtcore.meta import dtype_from_name

    out = {}
    for name, dtype, shape in spec:
        data = raw[name]
        flat = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = flat.view(dtype_from_name(dtype)).reshape(shape)
    return out
