"""Real vLLM servers (from the separate vLLM venv) and trainer processes for the tests.

Every process is started in a session of its own and stopped by its PID (its process group,
since vLLM starts an engine-core and a worker process under the API server), even on failure.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from wtcore.testing.net import free_port
from wtcore.testing.procs import stop_processes

__all__ = [
    "HERE",
    "MAIN_PYTHON",
    "VLLM_PYTHON",
    "Outputs",
    "VLLMServer",
    "generate",
    "run_trainer",
    "start_trainer",
    "stop_process",
]

#: Per prompt: the greedy token ids and their logprobs.
Outputs = list[tuple[list[int], list[float]]]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: The vLLM venv made by scripts/vllm-venv.sh; WTCORE_VLLM_PYTHON overrides it.
VLLM_PYTHON = Path(os.environ.get("WTCORE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MAIN_PYTHON = sys.executable
#: Fixed prompts (token ids of the tests' word-level tokenizer).
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 3, 42], [250, 17, 17, 9, 200, 31]]
#: Generous: on a loaded 2-core machine two servers starting at once took over 300 s.
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def stop_process(proc: subprocess.Popen[Any], *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group led by ``proc`` (its own session), then SIGKILL it: its
    children (engine core, worker) may outlive the leader."""
    stop_processes([proc], timeout_s, sig=signal.SIGTERM, group=True)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # the RL routes
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default would take far more than tiny models need
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("WTCORE_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


@dataclass
class VLLMServer:
    """One ``vllm serve`` process bound to 127.0.0.1 on a free port."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        model_dir: Path,
        log_path: Path,
        *,
        backend: str | None,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> VLLMServer:
        port = free_port()
        cmd = [str(VLLM_PYTHON), "-m", "wtcore_vllm.serve", str(model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
        cmd += ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "32"]
        if backend is not None:
            cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
        cmd += extra
        # vLLM's ZMQ sockets go to TMPDIR and outlive a stopped server: into a folder beside
        # the log (the caller's to remove), torch.compile's cache staying where it was.
        private_tmp = log_path.with_name(log_path.stem + "-tmp")
        private_tmp.mkdir(exist_ok=True)
        cache = Path(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        dirs = {"TMPDIR": str(private_tmp), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        log = log_path.open("wb")
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**server_env(), **dirs, **(env or {})},
                start_new_session=True,
            )
        finally:
            log.close()
        return cls(proc, port, log_path)

    def log_tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.proc.returncode} during startup:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready after {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.proc)

    # ------------------------------------------------------------------ calls
    def post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        r = requests.post(self.url + route, json=body, timeout=120)
        assert r.status_code == 200, f"POST {route}: {r.status_code} {r.text[:500]}"
        return r.json()

    def weight_version(self) -> Any:
        r = requests.get(self.url + "/weight_info", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["weight_version"]

    def checksums(self) -> dict[str, str]:
        return dict(self.post("/weight_checker", {"action": "checksum"})["checksums"])


@contextlib.contextmanager
def servers(
    specs: Sequence[tuple[Path, Path, str | None]],
    *,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    compiled: bool = False,
) -> Iterator[list[VLLMServer]]:
    """Start every server at once (startup is the slow part), wait for all, always stop all;
    ``extra`` options and ``env`` apply to each. They start eager (``--enforce-eager``):
    torch.compile is most of a start on CPU. ``compiled`` servers compile, as users' do: the
    staged module's, which shows the compiled model runs the weights of both kinds of round."""
    extra = extra if compiled else [*extra, "--enforce-eager"]
    started: list[VLLMServer] = []
    try:
        for model_dir, log_path, backend in specs:
            started.append(
                VLLMServer.start(model_dir, log_path, backend=backend, extra=extra, env=env)
            )
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.stop()


def generate(server: VLLMServer, model: str = "tiny") -> Outputs:
    """Greedy token ids and their logprobs for :data:`PROMPTS` (one request, fixed length), from
    the served model or a LoRA adapter it serves under ``model``."""
    body = {
        "model": model,
        "prompt": PROMPTS,
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, f"completions: {r.status_code} {r.text[:500]}"
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def trainer_cmd(
    url: str, state: Path | None, version: str | None, *extra: str, python: str = MAIN_PYTHON
) -> list[str]:
    """``state=None``: ``extra`` names the source (``--hf-model DIR``, with the vLLM venv)."""
    cmd = [python, str(HERE / "vllm_trainer.py"), "--url", url, "--port", str(free_port())]
    if state is not None:
        cmd += ["--state", str(state)]
    if version is not None:
        cmd += ["--version", version]
    return [*cmd, *extra]


def run_example(cmd: Sequence[str], *, timeout_s: float = 600.0) -> str:
    """Run ``cmd`` (an example's script) to its end in its own session; its output, asserting it
    succeeded. Stopped by PID whatever happens."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        stop_process(proc, timeout_s=5)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{cmd[1]} failed ({proc.returncode}):\n{text[-4000:]}"
    return text


def run_trainer(
    url: str,
    state: Path | None,
    version: str | None,
    *extra: str,
    python: str = MAIN_PYTHON,
    timeout_s: float = 120.0,
    expect_ok: bool = True,
) -> Any:
    """One full round in a trainer process.

    Returns its stats, or with ``expect_ok=False`` its output, and asserts that it failed.
    """
    proc = subprocess.Popen(
        trainer_cmd(url, state, version, *extra, python=python),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        stop_process(proc, timeout_s=5)
    text = out.decode(errors="replace")
    if not expect_ok:
        assert proc.returncode != 0, f"the round was expected to fail:\n{text[-3000:]}"
        return text
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{text[-3000:]}"
    # The stats line; an engine's native logs (Mooncake's glog, on stderr) may follow it.
    return json.loads(next(ln for ln in reversed(text.splitlines()) if ln.startswith("{")))


def start_trainer(url: str, state: Path, version: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        trainer_cmd(url, state, version, *extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def nccl_trainer_info(*, timeout_s: float, staged: bool = False) -> Any:
    """Init info for a wtcore ``nccl`` trainer in this process syncing one single-worker vLLM
    server (gloo on CPU, 64 KiB buckets so a round has many)."""
    from wtcore_nccl import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,  # this trainer and the server's one worker
        packed_buffer_size_bytes=64 << 10,
        packed_num_buffers=2,
        timeout_s=timeout_s,
        torch_num_threads=1,
        rank=0,
        staged=staged,
    )
