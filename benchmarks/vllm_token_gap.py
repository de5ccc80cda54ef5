"""The largest gap between streamed tokens while vLLM's weights are synced: staged against classic.

A client streams completions from a real vLLM CPU server without a break while a wtcore trainer
(nccl, gloo on CPU; ipc's ring, also received off vLLM's engine loop; or mooncake, which reads
inside it) syncs the server's weights, in turns: a staged round (vLLM keeps generating with the
old weights, then commits inside one finish call) and a classic one (``pause(keep)``, the round written into the
live model, ``resume``). For each sync it prints the largest gap between two tokens that
overlaps the sync, the median gap between tokens outside any sync (one decode step of the whole
batch), the commit time the server's workers report, the finish call as vLLM's own metrics time
it (the commit as the engine loop sees it: the workers' commit, the dispatch to them and the
version label), and which of the sync's calls the largest gap overlaps (none: the gap was not
the sync's; on 2 cores the trainer, the streaming client and vLLM share the CPU).

Run with the vLLM venv's Python (it has transformers, for the tiny checkpoint)::

    .venv-vllm/bin/python benchmarks/vllm_token_gap.py --rounds 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

from make_checkpoint import main as make_checkpoint  # noqa: E402
from vllm_kit import VLLMServer  # noqa: E402

EXTENSION = "wtcore_vllm.extension.WtcoreWorkerExtension"


def stream_tokens(url: str, started: Any, stop: Any, out: Any) -> None:
    """Back-to-back streamed requests (8 sequences of 100 tokens); ``started`` at the first
    chunk; puts each chunk's arrival time on ``out`` once ``stop`` is set. It runs in a process of its own: beside the trainer,
    the trainer's threads would delay its reads (vLLM's own inter-token latencies showed none
    of the gaps it measured then)."""
    body = {"model": "tiny", "prompt": [[5, 6, 7]] * 8, "max_tokens": 100, "stream": True}
    body |= {"temperature": 0.0, "ignore_eos": True}
    arrivals: list[float] = []
    while not stop.is_set():
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())  # one clock for every process
                    started.set()
    out.put(arrivals)


FINISH = 'vllm:rl_weight_update_operation_duration_seconds_sum{operation="finish"'


def finish_total(url: str) -> float:
    """Seconds vLLM has spent in finish calls so far (its ``/metrics``; 0 before the first)."""
    text = requests.get(url + "/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(FINISH))


def timed_calls(client: Any) -> list[tuple[str, float, float]]:
    """Record each call the trainer makes on ``client``: (name, start, end)."""
    calls: list[tuple[str, float, float]] = []
    names = ("start_weight_update", "update_weights", "finish_weight_update", "pause", "resume")

    def timing(name: str, call: Any) -> Any:
        def timed(*args: Any) -> Any:
            t = time.monotonic()
            try:
                return call(*args)
            finally:
                calls.append((name, t, time.monotonic()))

        return timed

    for name in names:
        setattr(client, name, timing(name, getattr(client, name)))
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="syncs of each kind, in turns")
    p.add_argument("--width", type=int, default=1, help="hidden sizes x this (1: 64)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backend", choices=("nccl", "ipc", "mooncake"), default="nccl")
    args = p.parse_args()
    # The trainer shares the cores with vLLM: busy-waiting torch threads here would starve it
    # (nccl's trainer does the same through torch_num_threads).
    torch.set_num_threads(1)
    import wtcore
    from wtcore.testing.net import free_port
    from wtcore_http_client import VLLMWeightSyncClient

    with tempfile.TemporaryDirectory(prefix="wtcore-gap-") as tmp:
        ckpt, state_path = Path(tmp) / "policy", Path(tmp) / "policy.pt"
        make_checkpoint(str(ckpt), str(state_path), 1, width=args.width, layers=args.layers)
        state = torch.load(state_path, weights_only=True)
        print(f"{sum(t.nbytes for t in state.values()) / 2**20:.1f} MiB in {len(state)} tensors")
        server = VLLMServer.start(
            ckpt,
            Path(tmp) / "vllm.log",
            backend=f"wtcore_{args.backend}",
            extra=["--worker-extension-cls", EXTENSION],
        )
        try:
            server.wait_ready()
            client = VLLMWeightSyncClient(server.url, timeout_s=120)
            calls = timed_calls(client)
            config: dict[str, Any] = {"backend": args.backend}
            if args.backend == "nccl":
                config |= {"master_address": "127.0.0.1", "master_port": free_port()}
                config |= {"world_size": 1 + client.get_world_size(), "torch_num_threads": 1}
            engine = wtcore.trainer_from_config(config, client=client)
            spawn = multiprocessing.get_context("spawn")
            started, stop, out = spawn.Event(), spawn.Event(), spawn.Queue()
            streaming = (server.url, started, stop, out)
            streamer = spawn.Process(target=stream_tokens, args=streaming)
            streamer.start()
            arrivals: list[float] = []
            syncs: list[tuple[str, float, float, float, float, float]] = []
            try:
                if not started.wait(120):
                    raise RuntimeError("the streaming client got no token in 120 s")
                time.sleep(2.0)
                for i in range(2 * args.rounds + 2):  # the first of each kind warms up
                    staged = i % 2 == 0
                    engine.init_info.staged = staged
                    finished = finish_total(server.url)
                    t0 = time.monotonic()
                    if not staged:
                        client.pause("keep")
                    stats = engine.send_weights(wtcore.TensorSource(state), weight_version=str(i))
                    if not staged:
                        client.resume()
                    else:  # KV computed with the old weights goes (a classic pause drops it)
                        r0 = time.monotonic()
                        server.post("/reset_prefix_cache")
                        calls.append(("reset_prefix_cache", r0, time.monotonic()))
                    t1 = time.monotonic()
                    times = stats.receiver_times or []
                    commit = max(t["commit_s"] for t in times)
                    paused = max(t["paused_s"] for t in times)
                    finish = finish_total(server.url) - finished
                    kind = "staged" if staged else "classic"
                    syncs.append((kind, t0, t1, commit, paused, finish))
                    time.sleep(1.0)
            finally:
                stop.set()
                arrivals = out.get(timeout=120)
                streamer.join(30)
                engine.shutdown()
                client.close()
        finally:
            server.stop()
    gaps = [(a, b - a) for a, b in itertools.pairwise(arrivals)]
    outside = [g for a, g in gaps if not any(t0 - 1 < a < t1 + 1 for _, t0, t1, *_ in syncs)]
    step = statistics.median(g for g in outside if g > 1e-3)  # a step's chunks come together
    rows = []
    print("(one round of each kind first, to warm up: not counted)")
    for kind, t0, t1, commit, paused, finish in syncs[2:]:
        start, gap = max(((a, g) for a, g in gaps if a + g > t0 and a < t1), key=lambda x: x[1])
        overlaps = sorted({n for n, c0, c1 in calls if c1 > start and c0 < start + gap})
        rows.append(
            {"kind": kind, "sync_s": t1 - t0, "commit_s": commit, "paused_s": paused}
            | {"finish_s": finish, "max_gap_s": gap, "gap_from_s": start - t0}
            | {"gap_overlaps": overlaps}
        )
        print(
            f"{kind:7s} sync {t1 - t0:.3f} s, commit {commit:.3f} s (finish {finish:.3f} s), "
            f"paused {paused:.3f} s, "
            f"largest gap {gap:.3f} s from {start - t0:+.3f} s,"
            f" overlapping {', '.join(overlaps) or 'none of its calls'}"
        )
    print(f"one decode step (median gap outside the syncs): {step:.4f} s")
    print(json.dumps({"decode_step_s": step, "syncs": rows}))


if __name__ == "__main__":
    main()
