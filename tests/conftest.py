"""Shared test configuration: GPU tests skip themselves on machines without CUDA, and each test
starts from the session's bound on Mooncake's stalls.

``make quick`` runs every test not marked ``processes`` (nor ``vllm``, ``ray``, ``multinode``,
``gpu``). A test file (``pytestmark``) or a test function is marked ``processes`` when it starts
anything outside this one Python process or bound to a port: a child process (``subprocess``,
``multiprocessing``, ``pipe_fleet``, ``wtcore serve``, the ``wtcore`` console script,
``make -n``), a server (a receiver process, or a ``ReceiverHTTPServer``/``ThreadingHTTPServer``
on loopback in a thread), a ``torch.distributed`` group or ``TCPStore`` (the nccl engine's gloo
groups, even with ranks on threads), Ray, vLLM, or network-namespace nodes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests(items)


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mooncake_stall_bound() -> Iterator[None]:
    """A mooncake worker sets its process's bound on stalled transfers
    (``wtcore_mooncake.te.bound_stalls``): restored after each test, so that no later test,
    nor a process it starts, inherits one test's."""
    name = "MC_TCP_PROGRESS_TIMEOUT_SEC"
    before = os.environ.get(name)
    yield
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before
