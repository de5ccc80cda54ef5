"""``wtcore bench --nodes/--link-rate/--engine-option``: the checks that need no namespaces.

The runs on real namespaced nodes are in tests/multinode/test_chain.py (root only).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from wtcore.cli import main
from wtcore.errors import PayloadError
from wtcore_bench.nodes import NODES_ENV, NodeSlot, Placement, placement

SMALL = ["--size", "64KiB", "--tensors", "4", "--rounds", "1", "--baselines", "none"]


def test_link_rate_needs_nodes(capsys: Any) -> None:
    assert main(["bench", "--link-rate", "1gbit"]) == 2
    assert "--link-rate needs --nodes" in capsys.readouterr().err


def test_nodes_need_a_client_that_places_receivers(capsys: Any) -> None:
    assert main(["bench", "--nodes", "1", "--client", "inproc"]) == 1
    err = capsys.readouterr().err
    assert "BenchNotSupportedError" in err and "cannot start receivers on other nodes" in err


def test_nodes_without_root_is_a_clear_error(monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "--nodes", "1", "--client", "http", "--backend", "nccl"]) == 1
    assert "--nodes: network-namespace clusters need root" in capsys.readouterr().err


def test_a_bad_link_rate_names_the_option(capsys: Any) -> None:
    assert main(["bench", "--nodes", "1", "--client", "http", "--link-rate", "fast"]) == 1
    assert "link rate: expected a tc rate like '1gbit'" in capsys.readouterr().err


def test_engine_options_reach_the_init_info(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "r.json"
    args = ["bench", *SMALL, "--engine-option", "packed_buffer_size_bytes=4096"]
    assert main([*args, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["engine_options"] == {"packed_buffer_size_bytes": 4096}
    assert record["runs"][0]["rounds"][0]["num_buckets"] > 1  # 4 KiB buckets, not the default
    assert main(["bench", *SMALL, "--engine-option", "no_such_field=1"]) == 1
    assert "--engine-option: InlineTrainerInitInfo has no field ['no_such_field']" in (
        capsys.readouterr().err
    )
    assert main(["bench", *SMALL, "--engine-option", "novalue"]) == 1
    assert "expected FIELD=VALUE, got 'novalue'" in capsys.readouterr().err


def test_placement_travels_in_the_environment(monkeypatch: Any) -> None:
    where = Placement("10.0.0.1", (NodeSlot("ns-a", "10.0.0.2"), NodeSlot("ns-b", "10.0.0.3")), "k")
    monkeypatch.setenv(NODES_ENV, where.to_env())
    got = placement()
    assert got == where
    assert [got.node_for(r).address for r in range(3)] == ["10.0.0.2", "10.0.0.3", "10.0.0.2"]
    assert got.node_for(1).argv(["x"]) == ["ip", "netns", "exec", "ns-b", "x"]
    monkeypatch.setenv(NODES_ENV, '{"nodes": 3}')
    with pytest.raises(PayloadError, match=NODES_ENV):
        placement()
    monkeypatch.delenv(NODES_ENV)
    assert placement() is None
