"""Fixtures for the ipc tests: the process helpers, shared worker processes, a leak check."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load_procs() -> ModuleType:
    name = "wtcore_ipc_test_procs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("ipc_procs.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


procs_module = _load_procs()


@pytest.fixture(scope="session")
def procs() -> ModuleType:
    return procs_module


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """After the whole run, no process these tests started still holds a segment."""
    yield
    import gc

    gc.collect()  # mappings of shared weights go with their last tensor
    left = procs_module.our_segments(procs_module.STARTED_PIDS)
    assert not left, f"shared-memory segments leaked: {left}"


@pytest.fixture(scope="module")
def two_workers() -> Iterator[list[Any]]:
    """Two worker processes, reused by the tests of one module (each test re-runs setup)."""
    workers = [procs_module.PipeWorker(rank=r, world_size=2) for r in range(2)]
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()
