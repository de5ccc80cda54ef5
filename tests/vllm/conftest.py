"""vLLM end-to-end fixtures: two tiny checkpoints and two real vLLM servers.

The tests run from the main venv; vLLM runs from its own venv (``scripts/vllm-venv.sh``), since
it pins its own torch and friends. Without that venv every test here is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vllm.vllm_kit import HERE, VLLM_PYTHON, Outputs, VLLMServer, generate, servers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(
        reason=f"no vLLM venv at {VLLM_PYTHON}; create it with scripts/vllm-venv.sh"
    )
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@dataclass(frozen=True)
class Checkpoint:
    dir: Path  # what vLLM serves
    state: Path  # the same tensors, torch.save'd, for the trainer


def make_checkpoints(
    root: Path, seeds: tuple[str, str], *, tied: bool, qwen2: bool = False, vocab: int = 0
) -> list[Checkpoint]:
    """Two checkpoints of one architecture (different seeds), written concurrently
    (``vocab``: the rows of the vocabulary, when not ``make_checkpoint.py``'s default)."""
    made = [Checkpoint(root / name, root / f"{name}.pt") for name in ("A", "B")]
    procs = [
        subprocess.Popen(
            [str(VLLM_PYTHON), str(HERE / "make_checkpoint.py"), str(c.dir), str(c.state), seed]
            + (["tied"] if tied else [])
            + (["qwen2"] if qwen2 else [])
            + ([f"vocab{vocab}"] if vocab else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for c, seed in zip(made, seeds, strict=True)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode(errors="replace")[-3000:]
    return made


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Checkpoint, Checkpoint]:
    """Checkpoints A and B: the same tiny Llama architecture, different seeds."""
    a, b = make_checkpoints(tmp_path_factory.mktemp("ckpt"), ("1", "2"), tied=False)
    return a, b


@dataclass(frozen=True)
class Servers:
    a: VLLMServer  # serves A, with the wtcore_nccl backend: the one the tests sync into
    ref: VLLMServer  # serves B, untouched: the reference
    ckpt_a: Checkpoint
    ckpt_b: Checkpoint
    original: Outputs  # what A generated before any sync
    reference: Outputs  # what the reference (B) generates
    ipc: VLLMServer | None = None  # serves A too, with wtcore_ipc (the tied fixture only)
    mooncake: VLLMServer | None = None  # serves A too, with wtcore_mooncake (the tied fixture)
    tcp: VLLMServer | None = None  # serves A too, with wtcore_tcp (sharded rounds)


@pytest.fixture(scope="session")
def vllm_servers(
    checkpoints: tuple[Checkpoint, Checkpoint], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    with serve(*checkpoints, tmp_path_factory.mktemp("vllm-logs"), tcp=True) as started:
        yield started


@pytest.fixture(scope="session")
def tied_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Like :func:`vllm_servers`, for a tiny Qwen2 (q/k/v biases) whose output layer is its
    input embedding, with more servers of A on ``wtcore_ipc`` and ``wtcore_mooncake``. Its 300
    rows of vocabulary are padded to 320 by vLLM, so the output layer is never complete from
    the checkpoint's rows alone."""
    root = tmp_path_factory.mktemp("ckpt-tied")
    a, b = make_checkpoints(root, ("3", "4"), tied=True, qwen2=True, vocab=300)
    with serve(a, b, tmp_path_factory.mktemp("vllm-logs-tied"), ipc=True) as started:
        yield started


@contextlib.contextmanager
def serve(
    a: Checkpoint,
    b: Checkpoint,
    logs: Path,
    *,
    ipc: bool = False,
    tcp: bool = False,
) -> Iterator[Servers]:
    """A with ``wtcore_nccl`` (with ``ipc``, A with ``wtcore_ipc`` and ``wtcore_mooncake``;
    with ``tcp``, A with ``wtcore_tcp``) and B as the reference, all started at once."""
    # The reference runs the adapter too: on CPU its checksums then read the packed weights.
    specs = [(a.dir, logs / "a.log", "wtcore_nccl"), (b.dir, logs / "ref.log", "wtcore_nccl")]
    if ipc:
        specs.append((a.dir, logs / "a-ipc.log", "wtcore_ipc"))
        specs.append((a.dir, logs / "a-mooncake.log", "wtcore_mooncake"))
    if tcp:
        specs.append((a.dir, logs / "a-tcp.log", "wtcore_tcp"))
    # wtcore's worker extension reports each round's times (the RL loop reads them); the
    # scale-out routes report each output's weight versions (test_vllm_staged.py).
    extra = ["--worker-extension-cls", "wtcore_vllm.extension.WtcoreWorkerExtension"]
    with servers(specs, extra=[*extra, "--enable-scale-out"]) as started:
        server_a, server_ref = started[:2]
        original, reference = generate(server_a), generate(server_ref)
        assert original != reference, "checkpoints A and B must generate differently"
        more = started[2:]
        assert all(generate(other) == original for other in more)
        ipc_ones = (more[0], more[1]) if ipc else (None, None)
        yield Servers(
            server_a,
            server_ref,
            a,
            b,
            original,
            reference,
            *ipc_ones,
            tcp=more[-1] if tcp else None,
        )
