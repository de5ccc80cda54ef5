"""Wire metadata, the dtype allow-list and typed payload parsing."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from wtcore import ParamMeta, PayloadError
from wtcore.meta import dtype_from_name, dtype_name, metas_from_wire, metas_to_wire
from wtcore.parse import parse_dataclass


def test_dtype_names_round_trip() -> None:
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("bad", ["Tensor", "__class__", "float128", 3, None, "nn"])
def test_dtype_allow_list_rejects(bad: object) -> None:
    with pytest.raises(PayloadError, match=r"dtype_names\[2\]: expected one of .*float32"):
        dtype_from_name(bad, field="dtype_names[2]")


def test_param_meta_sizes() -> None:
    m = ParamMeta("w", torch.bfloat16, (3, 4))
    assert (m.numel, m.nbytes) == (12, 24)
    assert ParamMeta("s", torch.float32, ()).nbytes == 4
    assert ParamMeta.of("x", torch.zeros(2, 0)).nbytes == 0


def test_metas_wire_round_trip() -> None:
    metas = [ParamMeta("a", torch.float32, (2, 3)), ParamMeta("b", torch.bool, ())]
    wire = metas_to_wire(metas)
    assert wire == {"names": ["a", "b"], "dtype_names": ["float32", "bool"], "shapes": [[2, 3], []]}
    assert metas_from_wire(**wire) == metas


@pytest.mark.parametrize(
    ("names", "dtypes", "shapes", "message"),
    [
        (["a"], ["float32", "float32"], [[1], [1]], "same length"),
        (["a", "a"], ["float32", "float32"], [[1], [1]], r"names\[1\]: duplicate name 'a'"),
        ([""], ["float32"], [[1]], r"names\[0\]: expected a non-empty string"),
        (["a"], ["float32"], [[-1]], r"shapes\[0\]: expected a list of non-negative integers"),
        (["a"], ["float32"], [[True]], r"shapes\[0\]"),
        (["a"], ["evil"], [[1]], r"dtype_names\[0\]"),
        ("a", ["float32"], [[1]], "names: expected a list, got str"),
    ],
)
def test_metas_from_wire_errors(
    names: object, dtypes: object, shapes: object, message: str
) -> None:
    with pytest.raises(PayloadError, match=message):
        metas_from_wire(names, dtypes, shapes)


@dataclass
class _Info:
    master_port: int
    names: list[str]
    ratio: float = 1.0
    tag: str | None = None
    flag: bool = False
    sizes: list[int] = field(default_factory=list)
    derived: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.master_port > 65535:
            raise ValueError(f"master_port: must be <= 65535, got {self.master_port}")


def test_parse_ok_and_int_widens_to_float() -> None:
    info = parse_dataclass(_Info, {"master_port": 1, "names": ["x"], "ratio": 2}, what="init_info")
    assert info == _Info(1, ["x"], 2.0)
    assert isinstance(info.ratio, float)
    sizes = [3, 0, 7]
    parsed = parse_dataclass(_Info, {"master_port": 1, "names": [], "sizes": sizes}, what="i")
    assert parsed.sizes == sizes and parsed.sizes is not sizes  # the payload's list, copied


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"names": []}, r"init_info.master_port: missing required field \(expected int\)"),
        (
            {"master_port": 1, "names": [], "bogus": 1},
            r"unknown field\(s\) 'bogus'; valid fields: master_port, names",
        ),
        ({"master_port": "1", "names": []}, r"init_info.master_port: expected int, got str '1'"),
        ({"master_port": True, "names": []}, r"init_info.master_port: expected int, got bool"),
        ({"master_port": 1, "names": [1]}, r"init_info.names\[0\]: expected str, got int"),
        ({"master_port": 1, "names": ["a", "b", 3]}, r"init_info.names\[2\]: expected str"),
        ({"master_port": 1, "names": [], "sizes": [1, True]}, r"init_info.sizes\[1\]: .*got bool"),
        ({"master_port": 1, "names": [], "flag": 1}, r"init_info.flag: expected bool, got int"),
        ({"master_port": 1, "names": [], "tag": 5}, r"init_info.tag: expected str \| NoneType"),
        ({"master_port": 70000, "names": []}, r"master_port: must be <= 65535, got 70000"),
        ([1, 2], r"init_info: expected a JSON object, got list"),
        ({"master_port": 1, "names": [], "derived": 3}, r"unknown field\(s\) 'derived'"),
    ],
)
def test_parse_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        parse_dataclass(_Info, data, what="init_info")
