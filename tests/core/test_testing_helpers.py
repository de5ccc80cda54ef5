"""The helpers every suite shares (``wtcore.testing``): one copy each, checked here once."""

from __future__ import annotations

import threading

import pytest
import torch

from wtcore import TensorSource
from wtcore.testing import (
    KillingSource,
    mixed_dtype_state,
    spec_of,
    state_of_spec,
    wait_until,
)


def test_killing_source_kills_just_before_the_named_item() -> None:
    state = mixed_dtype_state(3)
    seen: list[str] = []
    killed_at: list[int] = []
    src = KillingSource(TensorSource(state), lambda: killed_at.append(len(seen)), at=2)
    assert src.metadata() == TensorSource(state).metadata()
    for name, t in src:
        seen.append(name)
        assert torch.equal(t, state[name])
    assert seen == list(state) and killed_at == [2]


def test_spec_of_round_trips_names_dtypes_and_shapes_as_json() -> None:
    state = mixed_dtype_state(4)
    zeros = state_of_spec(spec_of(state))
    assert list(zeros) == list(state)
    for name, t in state.items():
        assert (zeros[name].dtype, zeros[name].shape) == (t.dtype, t.shape), name
        assert not zeros[name].any(), name


def test_wait_until_returns_once_true_and_names_what_never_happened() -> None:
    flag = threading.Event()
    threading.Timer(0.1, flag.set).start()
    wait_until(flag.is_set, 30.0, "the flag")
    with pytest.raises(AssertionError, match=r"timed out after 0\.2 s waiting for the peer"):
        wait_until(lambda: False, 0.2, "the peer")
