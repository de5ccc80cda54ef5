"""Synthetic models and sources for tests (the builders live in :mod:`wtcore_kit.synthetic`);
:func:`make_state` defines once the models several engines' process tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from wtcore.errors import PayloadError
from wtcore.meta import ParamMeta, metas_from_wire, metas_to_wire
from wtcore.source import WeightSource
from wtcore_kit.synthetic import build_module, synthetic_state, zeros_like_state

if TYPE_CHECKING:
    import torch

__all__ = [
    "MISMATCH_KINDS",
    "STATE_KINDS",
    "KillingSource",
    "MismatchedSource",
    "build_module",
    "make_state",
    "mixed_dtype_state",
    "spec_of",
    "state_of_spec",
    "synthetic_state",
    "zeros_like_state",
]

#: The ways :class:`MismatchedSource` can disagree with its metadata.
MISMATCH_KINDS: tuple[str, ...] = ("reordered", "redtyped", "reshaped", "missing", "extra")
#: The test models :func:`make_state` builds.
STATE_KINDS: tuple[str, ...] = ("edges", "layers", "wide")


def mixed_dtype_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors of every common dtype, including 0-d and empty ones."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "f32.weight": torch.randn(4, 5, generator=g),
        "bf16.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "f16.weight": torch.randn(16, generator=g).to(torch.float16),
        "i64.index": torch.randint(-(2**40), 2**40, (5,), generator=g, dtype=torch.int64),
        "bool.mask": torch.rand(6, generator=g) > 0.5,
        "scalar.zero_d": torch.randn((), generator=g),
        "empty.weight": torch.empty(0, 3),
        "big.weight": torch.randn(64, 64, generator=g),
    }


def make_state(
    seed: int, kind: str = "wide", *, big: int | None = None, count: int | None = None
) -> dict[str, torch.Tensor]:
    """A test model, the same for the same arguments (tests compare against a second call).

    ``kind``: ``"edges"`` (every dtype, 0-d and empty tensors, ``big.weight`` of ``big``
    float32 elements, then ``count`` tiny ones), ``"layers"`` (:func:`mixed_dtype_state`, then
    ``count`` layers of growing size and mixed dtypes, each with an int32 index) or ``"wide"``
    (:func:`mixed_dtype_state`, then ``count`` float32 layers); the last two end with
    ``huge.w`` of ``big`` elements if ``big``. Each kind has its own generator, so a model
    never changes when another kind does.
    """
    import torch

    if kind not in STATE_KINDS:
        raise PayloadError(f"kind must be one of {STATE_KINDS}, got {kind!r}")
    if kind == "edges":
        g = torch.Generator().manual_seed(seed)
        state = {
            "emb.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
            "big.weight": torch.randn(12_000 if big is None else big, generator=g),
            "fp16.weight": torch.randn(33, generator=g).to(torch.float16),
            "fp64.weight": torch.randn(5, 3, generator=g).double(),
            "idx.buffer": torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
            "mask.buffer": torch.rand(9, generator=g) > 0.5,
            "scalar.weight": torch.randn((), generator=g),
            "empty.weight": torch.empty(0, 4, dtype=torch.bfloat16),
        }
        for i in range(150 if count is None else count):
            state[f"tiny.{i}.weight"] = torch.randn(3, generator=g).to(
                torch.bfloat16 if i % 2 else torch.float32
            )
        return state
    state = mixed_dtype_state(seed)
    if kind == "layers":
        g = torch.Generator().manual_seed(seed)
        for i in range(24 if count is None else count):
            state[f"layers.{i}.w"] = torch.randn(33 + 7 * i, 17, generator=g).to(
                (torch.float32, torch.bfloat16, torch.float16)[i % 3]
            )
            state[f"layers.{i}.idx"] = torch.randint(
                0, 1000, (i + 1,), generator=g, dtype=torch.int32
            )
    else:
        g = torch.Generator().manual_seed(seed + 100)
        for i in range(6 if count is None else count):
            state[f"layers.{i}.weight"] = torch.randn(64, 48 + i, generator=g)
    if big:
        state["huge.w"] = torch.randn(big, generator=g)
    return state


class MismatchedSource(WeightSource):
    """Wraps a source so that iteration disagrees with metadata in one way (``kind``)."""

    def __init__(self, inner: WeightSource, kind: str) -> None:
        if kind not in MISMATCH_KINDS:
            raise PayloadError(f"kind must be one of {MISMATCH_KINDS}, got {kind!r}")
        self.inner = inner
        self.kind = kind

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        items = list(self.inner)
        if len(items) < 2:
            raise PayloadError("MismatchedSource needs at least two tensors")
        last = len(items) - 1
        if self.kind == "reordered":
            items[last - 1], items[last] = items[last], items[last - 1]
        elif self.kind == "redtyped":
            name, t = items[last]
            other = torch.float64 if t.dtype != torch.float64 else torch.float32
            items[last] = (name, t.to(other))
        elif self.kind == "reshaped":
            name, t = items[last]
            items[last] = (name, t.reshape(-1, 1) if t.dim() != 2 else t.reshape(-1))
        elif self.kind == "missing":
            items.pop()
        elif self.kind == "extra":
            items.append(("extra.weight", torch.zeros(3)))
        return iter(items)


class KillingSource(WeightSource):
    """Yields ``inner``'s tensors and calls ``kill()`` just before item ``at``: a receiver that
    dies mid-round, whatever the transport. The round opens in the background, so ``once`` (a
    condition waited for before the kill) makes sure the start reached the peer first.
    """

    def __init__(
        self,
        inner: WeightSource,
        kill: Callable[[], object],
        at: int,
        *,
        once: Callable[[], object] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.inner, self.kill, self.at = inner, kill, at
        self.once, self.timeout_s = once, timeout_s

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.at:
                if self.once is not None:
                    from wtcore.testing.waits import wait_until

                    wait_until(self.once, self.timeout_s, "the peer to open the round")
                self.kill()
            yield item


def spec_of(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The names, dtypes and shapes of ``state`` as the JSON wire triple, to build zeros from."""
    return metas_to_wire([ParamMeta.of(n, t) for n, t in state.items()])


def state_of_spec(spec: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Zeros shaped like :func:`spec_of`'s ``spec`` (checked as the wire is)."""
    import torch

    metas = metas_from_wire(spec["names"], spec["dtype_names"], spec["shapes"])
    return {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in metas}
