"""The helpers every suite shares (``wtcore.testing``): one copy each, checked here once."""

from __future__ import annotations

import threading

import pytest
import torch

from wtcore import PayloadError, TensorSource
from wtcore.testing import (
    KillingSource,
    make_state,
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


@pytest.mark.parametrize(
    ("kind", "args", "count", "big"),
    [
        ("edges", {}, 8 + 150, ("big.weight", 12_000)),
        ("edges", {"big": 64, "count": 20}, 8 + 20, ("big.weight", 64)),
        ("layers", {}, 8 + 2 * 24, None),
        ("layers", {"big": 1000}, 8 + 2 * 24 + 1, ("huge.w", 1000)),
        ("wide", {}, 8 + 6, None),
    ],
)
def test_make_state_is_one_builder_of_the_shared_test_models(
    kind: str, args: dict[str, int], count: int, big: tuple[str, int] | None
) -> None:
    """The nccl and tcp ("edges"), ipc ("layers") and Ray ("wide") tests' model: the same
    names, dtypes, shapes and bytes for the same arguments, another model for another seed."""
    state = make_state(7, kind, **args)
    again = make_state(7, kind, **args)
    assert len(state) == count and list(again) == list(state)
    for name, t in state.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name], t), name
    if big is not None:
        assert state[big[0]].numel() == big[1] and state[big[0]].dtype == torch.float32
    if kind != "edges":
        assert all(name in state for name in mixed_dtype_state(7))
    else:
        assert {t.dtype for t in state.values()} >= {torch.bfloat16, torch.float16, torch.bool}
    other = make_state(8, kind, **args)
    assert any(not torch.equal(other[n], t) for n, t in state.items() if t.numel())


def test_make_state_names_its_kinds() -> None:
    with pytest.raises(PayloadError, match=r"kind must be one of \('edges', 'layers', 'wide'\)"):
        make_state(0, "tiny")


def test_free_port_draws_below_the_kernels_ephemeral_range_and_never_twice() -> None:
    import socket

    from wtcore.testing import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == 100  # a test may pick several before it binds any
    # where no outgoing connection's source port, nor bind(0), can take it meanwhile
    assert all(p < low or p > high for p in ports), (low, high, ports)
    with socket.socket() as s:  # and it is free
        s.bind(("127.0.0.1", ports[-1]))


def test_free_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import random
    import socket

    import wtcore.testing.net as net

    with socket.socket() as busy, socket.socket() as probe:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        probe.bind(("127.0.0.1", 0))
        taken, free = busy.getsockname()[1], probe.getsockname()[1]
        probe.close()
        draws = iter([taken, taken, free])
        monkeypatch.setattr(net, "_ephemeral_range", lambda: (60000, 60999))
        monkeypatch.setattr(random, "choice", lambda pool: next(draws))
        assert net.free_port() == free  # the port in use was drawn twice and passed over
