"""Shared test configuration: the ``processes`` marker by folder, GPU tests skip themselves on
machines without CUDA, and each test starts from the session's bound on Mooncake's stalls.

``make quick`` runs every test not marked ``processes`` (nor ``vllm``, ``ray``, ``multinode``,
``gpu``). A test is marked ``processes`` when it starts anything outside this one Python process
or bound to a port: a child process (``subprocess``, ``multiprocessing``, ``pipe_fleet``,
``wtcore serve``, the ``wtcore`` console script, ``make -n``), a server (a receiver process, or a
``ReceiverHTTPServer``/``ThreadingHTTPServer`` on loopback in a thread), a ``torch.distributed``
group or ``TCPStore`` (the nccl engine's gloo groups, even with ranks on threads), Ray, vLLM, or
network-namespace nodes. :data:`PROCESSES` says which, by folder, then file, then test function;
the most specific entry wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: ``True``: marked ``processes``; ``False``: quick. Keys are relative to ``tests/``: a folder,
#: ``folder/file.py``, or ``folder/file.py::function`` (every parametrization of the function).
#: A folder not listed is quick; so is a file in no listed folder.
PROCESSES: dict[str, bool] = {
    # ---- core: in-process engines, workers and clients; the CLI and the docs run as children
    "core/test_cli.py": True,  # the console script, as a subprocess
    "core/test_cli_plugins.py": True,  # `wtcore plugins` as a subprocess, fake plugins on a path
    "core/test_cli_errors.py::test_console_script_unknown_backend_is_one_line": True,
    "core/test_dtensor_source.py": True,  # two spawned ranks, a gloo process group
    "core/test_on_ranks.py": True,  # spawned ranks, a gloo rendezvous
    "core/test_gpu_check.py": True,  # scripts/gpu-check.sh
    "core/test_held_source.py::test_pipeline_stages_plan_alike_and_send_only_what_they_hold": True,
    "core/test_receiver_layout.py::test_trainer_plans_from_reports_read_over_http_and_each_receiver_gets_only_its_slices": True,
    "core/test_sharded_inline.py::test_each_rank_sends_its_part_and_each_receiver_gets_its_slice": True,
    "core/test_sharded_doc.py": True,  # two trainer processes, HTTP receivers
    "core/test_sharded_inline.py::test_a_round_a_trainer_rank_cuts_short_is_never_published": True,
    "core/test_sharded_inline.py::test_a_rank_that_breaks_fails_the_round_everywhere_and_the_next_round_recovers": True,
    # ---- tcp: sharded rounds spawn their trainer ranks (a gloo group)
    "tcp/test_sharded_tcp.py::test_each_rank_sends_its_part_and_each_receiver_gets_its_slice": True,
    "tcp/test_sharded_tcp.py::test_a_rank_that_breaks_fails_the_round_everywhere_and_the_next_round_recovers": True,
    # ---- nccl: sharded rounds spawn their trainer ranks (a gloo group)
    "nccl/test_sharded_nccl.py::test_each_rank_sends_its_part_and_each_receiver_gets_its_slice": True,
    "nccl/test_sharded_nccl.py::test_a_rank_that_breaks_fails_the_round_everywhere_and_the_next_round_recovers": True,
    "core/test_lazy_import.py": True,  # a fresh interpreter
    "core/test_pipes.py": True,  # pipe_fleet: worker child processes
    "core/test_procs.py": True,  # stop_processes on real children
    "core/test_readme.py": True,  # the README's quick start as a subprocess
    "core/test_self_contained.py": True,  # git ls-files / grep
    # ---- bench (tests/bench, or tests/core/test_bench*.py before the move): in process
    # (the inproc client), except where the CLI runs as a child
    "bench/test_bench.py": True,  # `wtcore bench` as a subprocess
    "bench/test_bench_sharded.py": True,  # trainer ranks and receivers as processes
    "bench/test_bench_api.py::test_plot_without_matplotlib_from_the_cli_prints_one_line": True,
    "bench/test_bench_peers.py::test_device_cuda_without_cuda_is_one_clear_line": True,
    "bench/test_bench_turns.py::test_interleaved_limits_are_the_median_of_their_turns_before_each_round": True,
    "bench/test_bench_turns.py::test_without_interleave_every_limit_is_measured_before_the_rounds": True,
    # ---- docs: `make -n` for shell blocks; docs/http.md's blocks against real receivers
    "docs/test_code_blocks.py::test_shell_blocks": True,
    "docs/test_code_blocks.py::test_python_blocks": True,
    "docs/test_code_blocks.py::test_the_shell_rules_catch_a_broken_command": True,  # make -n
    # ---- http_client: receivers are `wtcore serve` processes or servers on loopback threads
    "http_client": True,
    "http_client/test_safetensors.py": False,
    "http_client/test_wire.py::test_the_routes_accept_exactly_those_bodies": False,
    "http_client/test_wire.py::test_bad_base_urls": False,
    "http_client/test_wire.py::test_the_round_id_travels_in_a_header_and_guards_the_round": False,
    # ---- ipc: the contract suites run workers on threads over shared memory; the rest spawn
    "ipc/test_cuda.py": True,
    "ipc/test_processes.py": True,
    "ipc/test_shared_weights.py": True,
    "ipc/test_shm_hostile.py": True,
    # ---- nccl: real gloo groups and TCP stores (ranks on threads or processes)
    "nccl": True,
    "nccl/test_buffer_pool.py": False,
    "nccl/test_config_nccl.py": False,
    "nccl/test_config_nccl.py::test_import_does_not_import_torch": True,
    "nccl/test_gloo_devices.py": False,
    # ---- ray_client: a local Ray cluster
    "ray_client": True,
    "ray_client/test_units.py": False,  # the actor classes without Ray
    "ray_client/test_units.py::test_import_does_not_import_ray": True,
    # ---- reliability: the fault matrix and the network fuzzing use `wtcore serve` processes
    "reliability/test_fault_matrix.py": True,
    "reliability/test_fuzz_http.py::test_serve_process_fuzz": True,
    "reliability/test_fuzz_http.py::test_other_standard_methods_get_a_json_405": True,
    # ---- release: builds every distribution and a fresh venv; the metadata checks read files
    "release": True,
    "release/test_metadata.py": False,
    # ---- mooncake: the suites run workers on threads of this process; the rest spawn
    "mooncake/test_processes.py": True,
    "mooncake/test_bench_mooncake.py": True,  # spawned readers, wtcore serve receivers
    "mooncake/test_hostile.py::test_a_trainer_that_dies_or_stalls_fails_the_round_in_time_naming_it": True,
    # ---- trl: the source over TRL's iterator, in process; one round over a real gloo group
    "trl/test_adapter.py::test_a_round_from_an_iterator_that_reshards_behind_it_is_exact": True,
    # ---- whole folders of real processes
    "integration": True,  # `wtcore bench` per engine x client, GPU processes
    "multinode": True,  # network-namespace nodes
    "vllm": True,  # vLLM servers
}


def _key(item: pytest.Item) -> tuple[str, str, str]:
    """``(folder, folder/file.py, folder/file.py::function)`` of ``item``, relative to tests/."""
    path = Path(str(item.fspath)).resolve()
    try:
        rel = path.relative_to(TESTS)
    except ValueError:  # a test outside tests/ (a path given on the command line)
        return "", "", ""
    folder, name = (rel.parts[0] if len(rel.parts) > 1 else ""), rel.name
    if folder == "core" and name.startswith("test_bench"):
        folder = "bench"  # the bench tests, before their move to tests/bench
    function = getattr(item, "originalname", None) or item.name.split("[")[0]
    file = f"{folder}/{name}"
    return folder, file, f"{file}::{function}"


def starts_processes(item: pytest.Item) -> bool:
    """Whether :data:`PROCESSES` marks ``item`` (the most specific matching entry decides)."""
    for key in reversed(_key(item)):
        if key in PROCESSES:
            return PROCESSES[key]
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.processes)
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
