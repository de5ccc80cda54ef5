"""TRL's announced metadata and its single-pass iterator, as a wtcore source."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError, ProtocolStateError
from wtcore.meta import ParamMeta, dtype_from_name
from wtcore.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = ["StreamSource", "metas_of"]


def metas_of(metadata: Sequence[Any]) -> list[ParamMeta]:
    """TRL's ``[(name, dtype without "torch.", shape)]`` as wtcore metadata, checked."""
    metas: list[ParamMeta] = []
    for i, entry in enumerate(metadata):
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise PayloadError(f"metadata[{i}]: expected (name, dtype, shape), got {entry!r:.80}")
        name, dtype, shape = entry
        if not isinstance(name, str) or not isinstance(shape, (list, tuple)):
            raise PayloadError(f"metadata[{i}]: expected a str name and a shape list")
        dims = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise PayloadError(f"metadata[{i}].shape: expected non-negative ints, got {shape!r}")
        metas.append(ParamMeta(name, dtype_from_name(dtype, field=f"metadata[{i}].dtype"), dims))
    return metas


class StreamSource(WeightSource):
    """The tensors TRL announces, read once from its iterator, each one copied as it is read:
    under ZeRO-3 or FSDP1 a gathered tensor is re-sharded once the iterator moves on, while an
    engine may still be sending it."""

    def __init__(self, metadata: Sequence[Any], named_params: Iterator[tuple[str, torch.Tensor]]):
        self._metas = metas_of(metadata)
        self._params = named_params
        self._read = False

    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._read:
            raise ProtocolStateError(
                "TRL's parameter iterator is single-pass and was read already; a second pass "
                "would need a second gather"
            )
        self._read = True
        for name, tensor in self._params:
            yield name, tensor.detach().clone()
