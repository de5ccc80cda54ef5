"""The tiny safetensors reader behind ``wtcore serve --safetensors``."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import PayloadError
from wtcore.testing.sources import mixed_dtype_state
from wtcore_http_client.safetensors import load_safetensors, save_safetensors


def _write(path: Path, header: dict[str, Any], data: bytes) -> Path:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def test_reads_a_hand_built_file(tmp_path: Path) -> None:
    """Built byte by byte from the format description, independently of the writer."""
    a = struct.pack("<4f", 1.0, -2.0, 3.5, 0.25)
    b = struct.pack("<3q", 7, -(2**40), 0)
    c = bytes([1, 0, 1])
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "I64", "shape": [3], "data_offsets": [16, 40]},
        "c": {"dtype": "BOOL", "shape": [3], "data_offsets": [40, 43]},
        "e": {"dtype": "BF16", "shape": [0, 4], "data_offsets": [43, 43]},
    }
    got = load_safetensors(_write(tmp_path / "x.safetensors", header, a + b + c))
    assert list(got) == ["a", "b", "c", "e"]
    assert torch.equal(got["a"], torch.tensor([[1.0, -2.0], [3.5, 0.25]]))
    assert torch.equal(got["b"], torch.tensor([7, -(2**40), 0]))
    assert torch.equal(got["c"], torch.tensor([True, False, True]))
    assert got["e"].shape == (0, 4) and got["e"].dtype == torch.bfloat16


def test_round_trip_every_dtype(tmp_path: Path) -> None:
    state = mixed_dtype_state(3)
    save_safetensors(state, tmp_path / "m.safetensors", metadata={"step": "3"})
    got = load_safetensors(tmp_path / "m.safetensors")
    assert list(got) == list(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # the header is padded to 8 bytes, as the format asks
    (n,) = struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])
    assert n % 8 == 0


@pytest.mark.parametrize(
    ("header", "data", "fragment"),
    [
        ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "'C64'"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), "expected 8"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, bytes(4), "out of"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "shape"),
        ({"w": {"dtype": "F32", "shape": [1]}}, bytes(4), "data_offsets"),
        ([1, 2], b"", "header must be a JSON object"),
    ],
)
def test_bad_files_name_the_tensor(tmp_path: Path, header: Any, data: bytes, fragment: str) -> None:
    path = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(PayloadError, match="bad.safetensors") as err:
        load_safetensors(path)
    assert fragment in str(err.value)
    if isinstance(header, dict):
        assert "tensor 'w'" in str(err.value)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(PayloadError, match="header length 1000 does not fit"):
        load_safetensors(path)
