"""``send_weights(verify=True)``: receivers' checksums against digests of what was sent, taken
as tensors are materialized (a second pass would mean a second FSDP gather)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from wtcore.client import InspectableClient
from wtcore.digest import tensor_digest
from wtcore.errors import PayloadError, VerificationError
from wtcore.meta import ParamMeta
from wtcore.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = ["DigestingSource", "VerifyingClient"]


class DigestingSource(WeightSource):
    """A pass-through source that records the digest of every tensor it yields."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.digests: dict[str, str] = {}

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.digests = {}
        for name, t in self.inner:
            self.digests[name] = tensor_digest(t)
            yield name, t


class VerifyingClient:
    """Forwards every call; checks receivers' checksums before forwarding the finish."""

    def __init__(self, inner: object, source: DigestingSource) -> None:
        if not isinstance(inner, InspectableClient):
            raise PayloadError(
                f"verify=True needs an InspectableClient (with checksums()); "
                f"{type(inner).__name__} is not one (wrap workers in InProcessClient)"
            )
        self.inner: InspectableClient = inner
        self.source = source
        #: Each receiver's landed bytes of the round, read by :meth:`check`.
        self.landed: list[int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.check()
        self.inner.finish_weight_update(weight_version)

    def check(self) -> None:
        """Raise :class:`VerificationError` unless every receiver holds what was sent."""
        per_receiver = self.inner.checksums()
        expected = self.source.digests
        problems: list[str] = []
        for i, digests in enumerate(per_receiver):
            bad = [n for n, d in expected.items() if digests.get(n) != d]
            if bad:
                shown = ", ".join(map(repr, bad[:5])) + (", ..." if len(bad) > 5 else "")
                problems.append(
                    f"receiver {i}: {len(bad)} of {len(expected)} tensors differ ({shown})"
                )
        counts = [i.get("round_bytes", {}).get("landed") for i in self.inner.weight_info()]
        self.landed = counts if all(isinstance(c, int) for c in counts) else None
        if problems:
            raise VerificationError(
                "verification failed; the round was NOT finished, no receiver published the "
                "new version, and the round is aborted on every receiver (the next send_weights "
                "re-initializes them):\n  - " + "\n  - ".join(problems)
            )
