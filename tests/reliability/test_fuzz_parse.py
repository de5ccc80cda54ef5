"""Fuzzed payloads against every registered worker engine's ``parse_init_info`` and
``parse_update_info``: the answer is a typed object or a ``PayloadError`` naming the field,
never another exception type.

Two kinds of input: arbitrary JSON-like values (mostly wrong at the top level or through
unknown keys), and dicts built from each engine's real field names with arbitrary values, so
the fuzzer reaches the type checks and each dataclass's ``__post_init__`` validation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wtcore
from wtcore import ModuleSink, PayloadError, WeightTransferEngineFactory

pytestmark = pytest.mark.timeout(120)

ENGINES = ["inline", "nccl", "tcp", "ipc", "mooncake"]

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Values a JSON decoder can produce (Python's json also accepts NaN and +-Infinity), plus
# the awkward ones: huge and negative ints, bools where ints are expected, unicode.
_ints = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 64, 4096, 1 << 30]),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", "float32", "bfloat16", "gloo", "nccl", "auto", "127.0.0.1", "é\u0000"]),
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=12), inner, max_size=5),
    ),
    max_leaves=20,
)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _shaped_dicts(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts over ``cls``'s real field names (some dropped), with arbitrary values."""
    names = _field_names(cls)
    wire = {
        "names": st.lists(st.text(max_size=8), max_size=4),
        "dtype_names": st.lists(
            st.sampled_from(["float32", "bfloat16", "int64", "bool", "complex32", "x", ""]),
            max_size=4,
        ),
        "shapes": st.lists(st.lists(_ints, max_size=3), max_size=4),
        "sizes": st.lists(_ints, max_size=4),
    }
    value = {n: st.one_of(wire.get(n, json_values), json_values) for n in names}
    return st.fixed_dictionaries({}, optional=value)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Any:
    model = torch.nn.Linear(4, 2)
    eng = WeightTransferEngineFactory.create_engine(request.param, sink=ModuleSink(model))
    yield eng
    eng.shutdown()


def _parse_or_payload_error(parse: Any, data: Any) -> None:
    try:
        parse(data)
    except PayloadError as e:
        assert isinstance(e, ValueError)
        assert str(e), "a PayloadError must say what was wrong"
    # any other exception type fails the test (hypothesis shrinks and reports it)


@FUZZ
@given(data=json_values)
def test_parse_init_info_any_json(engine: Any, data: Any) -> None:
    _parse_or_payload_error(engine.parse_init_info, data)


@FUZZ
@given(data=json_values)
def test_parse_update_info_any_json(engine: Any, data: Any) -> None:
    _parse_or_payload_error(engine.parse_update_info, data)


@FUZZ
@given(st.data())
def test_parse_init_info_real_fields(engine: Any, data: st.DataObject) -> None:
    payload = data.draw(_shaped_dicts(engine.init_info_cls))
    _parse_or_payload_error(engine.parse_init_info, payload)


@FUZZ
@given(st.data())
def test_parse_update_info_real_fields(engine: Any, data: st.DataObject) -> None:
    payload = data.draw(_shaped_dicts(engine.update_info_cls))
    _parse_or_payload_error(engine.parse_update_info, payload)


def test_every_registered_engine_is_fuzzed() -> None:
    """A new worker engine joins this suite: fail until it is listed in ``ENGINES``.

    Only engines that a distribution provides count; other tests register throwaway engines
    at runtime (the tutorial's ``tmpfile``), which are not part of what we ship.
    """
    registry = wtcore.ENGINES
    installed = {n for n in registry.names() if registry.info(n).distribution is not None}
    assert installed <= set(ENGINES), f"add {sorted(installed - set(ENGINES))} to ENGINES"


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300, 86400.5])
def test_nccl_timeout_must_be_finite_and_bounded(timeout_s: float) -> None:
    """Found by this fuzzer: ``"timeout_s": Infinity`` (valid for Python's JSON decoder)
    passed parsing, then overflowed inside torch at init (an HTTP 500 for a client error, and
    a way around "every wait has a timeout"). It is now a PayloadError naming the field."""
    worker = wtcore.WeightSyncWorker("nccl", ModuleSink(torch.nn.Linear(2, 2)))
    init = {
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": timeout_s,
    }
    with pytest.raises(PayloadError, match=r"timeout_s: expected a positive number of seconds"):
        worker.engine.parse_init_info(init)
    with pytest.raises(PayloadError, match="timeout_s"):
        worker.init_weight_transfer_engine(init)
    assert worker.weight_info()["state"] == "uninitialized"
    worker.shutdown()
