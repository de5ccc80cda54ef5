"""``wtcore serve --safetensors``'s reader and writer: the ``safetensors`` package behind wtcore's
errors (a bad file is a ``PayloadError`` naming the file; a missing package names the extra)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from wtcore import PayloadError, PluginLoadError, WtcoreError
from wtcore.testing.sources import mixed_dtype_state
from wtcore_http_client.safetensors import INSTALL_HINT, load_safetensors, save_safetensors


def _write(path: Path, header: Any, data: bytes) -> Path:
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
    assert sorted(got) == ["a", "b", "c", "e"]
    assert torch.equal(got["a"], torch.tensor([[1.0, -2.0], [3.5, 0.25]]))
    assert torch.equal(got["b"], torch.tensor([7, -(2**40), 0]))
    assert torch.equal(got["c"], torch.tensor([True, False, True]))
    assert got["e"].shape == (0, 4) and got["e"].dtype == torch.bfloat16


def test_round_trip_every_dtype_with_metadata(tmp_path: Path) -> None:
    from safetensors import safe_open

    state = mixed_dtype_state(3)
    path = tmp_path / "m.safetensors"
    save_safetensors(state, path, metadata={"step": "3"})
    got = load_safetensors(path)
    assert sorted(got) == sorted(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "3"}
    # the header is padded to 8 bytes, as the format asks
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0


def test_writes_tied_and_non_contiguous_tensors(tmp_path: Path) -> None:
    """A state dict may hold tied weights (shared storage) and views; both are written whole."""
    emb = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"embed.weight": emb, "lm_head.weight": emb, "t.weight": emb.t()}
    save_safetensors(state, tmp_path / "tied.safetensors")
    got = load_safetensors(tmp_path / "tied.safetensors")
    for name, t in state.items():
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize(
    ("header", "data"),
    [
        ({"w": {"dtype": "X99", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, bytes(4)),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
        ({"w": {"dtype": "F32", "shape": [1]}}, bytes(4)),
        ([1, 2], b""),
    ],
)
def test_bad_files_are_payload_errors_naming_the_file(
    tmp_path: Path, header: Any, data: bytes
) -> None:
    path = _write(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(PayloadError, match=r"bad\.safetensors: not a valid safetensors file \("):
        load_safetensors(path)


def test_truncated_and_empty_files(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(PayloadError, match="t.safetensors: not a valid safetensors file"):
        load_safetensors(path)
    path.write_bytes(b"")
    with pytest.raises(PayloadError, match="t.safetensors"):
        load_safetensors(path)
    with pytest.raises(PayloadError, match="nope.safetensors: no such safetensors file"):
        load_safetensors(tmp_path / "nope.safetensors")


def test_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the optional package, both calls say which extra to install."""
    # None in sys.modules makes the import itself fail, as it would where it is not installed.
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    for call in (
        lambda: load_safetensors(tmp_path / "m.safetensors"),
        lambda: save_safetensors({"w": torch.zeros(2)}, tmp_path / "m.safetensors"),
    ):
        with pytest.raises(PluginLoadError) as err:
            call()
        assert isinstance(err.value, WtcoreError) and isinstance(err.value, ImportError)
        assert INSTALL_HINT in str(err.value)
        assert "wtcore-http-client[safetensors]" in str(err.value)
