"""Run the RL loop against a real vLLM CPU server: a control run (sync off), a synced run, and
an async run (the next batch generated while the previous step's weights are staged).

Runs with the vLLM venv's Python (the trainer's policy is transformers' ``LlamaForCausalLM``, the
class vLLM serves, built from the same checkpoint):

    .venv-vllm/bin/python examples/rl_loop/run.py --json rl.json --plot rl.png

Without ``--url``, it builds the tiny checkpoint of the vLLM tests (``tests/vllm``, nothing
downloaded), starts one vLLM server with ``--weight-transfer-config '{"backend":
"wtcore_<backend>"}'`` and :data:`SERVER_OPTIONS`, and stops it at the end. With ``--url`` and
``--checkpoint`` it uses a server already serving that checkpoint with a wtcore backend and
those options (the CI test does this).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The vLLM tests' tools: the tiny checkpoint and the server process (started and stopped by
# process group), shared rather than copied.
sys.path[:0] = [str(HERE), str(ROOT / "tests" / "vllm")]

from loop import MODES, LoopConfig, StepRecord, final_gap, run_loop  # noqa: E402

RUNS = MODES
#: What the server needs: wtcore's worker extension (its workers' round times) and the token
#: route (which weight versions sampled each completion's tokens).
SERVER_OPTIONS = [
    "--worker-extension-cls",
    "wtcore_vllm.extension.WtcoreWorkerExtension",
    "--enable-scale-out",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--url", help="vLLM serving --checkpoint, a wtcore backend, " + " ".join(SERVER_OPTIONS)
    )
    p.add_argument("--checkpoint", type=Path, help="the checkpoint folder that server serves")
    p.add_argument("--backend", choices=("nccl", "ipc"), default="nccl")
    p.add_argument("--steps", type=int, default=LoopConfig.steps)
    p.add_argument("--group-size", type=int, default=LoopConfig.group_size)
    p.add_argument("--max-tokens", type=int, default=LoopConfig.max_tokens)
    p.add_argument("--lr", type=float, default=LoopConfig.lr)
    p.add_argument("--seed", type=int, default=LoopConfig.seed)
    p.add_argument("--runs", default=",".join(RUNS), help="which runs, in order: " + ",".join(RUNS))
    p.add_argument("--json", type=Path, help="write every step of every run here")
    p.add_argument("--plot", type=Path, help="draw reward, mismatch, sync/paused time (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (lines only)")
    args = p.parse_args(argv)
    if (args.url is None) != (args.checkpoint is None):
        p.error("--url and --checkpoint go together")
    if any(r not in RUNS for r in args.runs.split(",")):
        p.error(f"--runs: expected names from {', '.join(RUNS)}")
    return args


def step_line(run: str, steps: int, rec: StepRecord) -> str:
    paused = "-" if rec.paused_s is None else f"{rec.paused_s:.2f}"
    return (
        f"{run:7s} step {rec.step:2d}/{steps}  reward {rec.reward:.3f}  "
        f"mismatch {rec.mismatch_mean:.2e} (max {rec.mismatch_max:.2e})  "
        f"sync {rec.sync_s:.2f} s ({rec.sync_share:4.0%} of {rec.step_s:.2f} s), "
        f"paused {paused} s, {rec.tokens_in_flight} tokens in flight  "
        f"vllm version {rec.vllm_version}, sampled by version "
        + ", ".join(f"{v} ({n} tokens)" for v, n in rec.token_versions.items())
    )


def make_engine(backend: str, client: Any, model: torch.nn.Module, *, staged: bool) -> Any:
    """The trainer's wtcore engine: ``nccl`` (gloo on CPU) or ``ipc`` (same host only)."""
    import wtcore
    from wtcore.testing.net import free_port

    config: dict[str, Any] = {"backend": backend, "timeout_s": 120.0, "staged": staged}
    if backend == "nccl":
        config.update(
            master_address="127.0.0.1",  # this trainer hosts the rendezvous
            master_port=free_port(),
            world_size=1 + client.get_world_size(),  # the sender plus every vLLM worker
            torch_num_threads=1,
        )
    return wtcore.trainer_from_config(config, client=client, source=wtcore.ModuleSource(model))


def run_all(args: argparse.Namespace, url: str, checkpoint: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from wtcore_http_client import VLLMWeightSyncClient

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base = LoopConfig(args.steps, args.group_size, args.max_tokens, args.lr, args.seed)
    log: dict[str, Any] = {"config": asdict(base) | {"backend": args.backend}, "runs": {}}
    with VLLMWeightSyncClient(url, timeout_s=300.0) as client:
        for run in args.runs.split(","):
            cfg = replace(base, mode=run)
            engine = make_engine(args.backend, client, model, staged=run == "async")
            try:
                log["runs"][run] = one_run(run, cfg, url, model, initial, client, engine, args)
            finally:
                engine.shutdown()
    speeds = {k: v["steps_per_min"] for k, v in log["runs"].items() if k != "control"}
    if len(speeds) == 2:
        print(f"async vs synced: {speeds['async'] / speeds['synced']:.2f}x the steps per minute")
    return log


def one_run(
    run: str,
    cfg: LoopConfig,
    url: str,
    model: torch.nn.Module,
    initial: dict[str, torch.Tensor],
    client: Any,
    engine: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One run, printed a line per step under a progress bar; its part of the JSON log."""
    bar = _progress(run, cfg.steps, disable=args.no_progress)
    start = time.perf_counter()

    def on_step(rec: StepRecord) -> None:
        bar.write(step_line(run, cfg.steps, rec), file=sys.stdout)
        bar.update(1)

    try:
        records = run_loop(
            url=url,
            model=model,
            initial_state=initial,
            client=client,
            engine=engine,
            cfg=cfg,
            on_step=on_step,
        )
    finally:
        bar.close()
    wall_s = time.perf_counter() - start
    loop_s = sum(r.step_s for r in records)  # from the first request to the last step's end
    final = final_gap(url, model, cfg)
    print(summary_line(run, records, final), flush=True)
    return {
        "mode": cfg.mode,
        "sync": cfg.sync,
        "wall_s": wall_s,
        "loop_s": loop_s,
        "steps_per_min": 60 * len(records) / loop_s,
        "final_mismatch_max": final,  # a fresh batch after the last step (loop.final_gap)
        "steps": [asdict(r) for r in records],
    }


def summary_line(run: str, records: list[StepRecord], final: float) -> str:
    k = max(1, len(records) // 5)
    first = sum(r.reward for r in records[:k]) / k
    last = sum(r.reward for r in records[-k:]) / k
    worst = max(r.mismatch_max for r in records)
    loop_s = sum(r.step_s for r in records)
    paused = sum(r.paused_s or 0.0 for r in records)
    return (
        f"{run}: reward {first:.3f} -> {last:.3f} (mean of the first/last {k} steps), "
        f"mismatch max {worst:.2e} (after the last step {final:.2e}), "
        f"{60 * len(records) / loop_s:.1f} steps/min, "
        f"sync {sum(r.sync_s for r in records):.2f} s, paused {paused:.2f} s in total"
    )


def _progress(run: str, total: int, *, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=run, unit="step", file=sys.stderr, disable=disable)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.url is not None:
        log = run_all(args, args.url.rstrip("/"), args.checkpoint)
    else:
        from make_checkpoint import main as make_checkpoint
        from vllm_kit import VLLMServer

        with tempfile.TemporaryDirectory(prefix="wtcore-rl-") as tmp:
            ckpt = Path(tmp) / "policy"
            make_checkpoint(str(ckpt), str(Path(tmp) / "policy.pt"), 1)
            log_path = Path(tmp) / "vllm.log"
            print(f"starting vLLM (CPU) on the tiny policy; its log: {log_path}", flush=True)
            backend = f"wtcore_{args.backend}"
            server = VLLMServer.start(ckpt, log_path, backend=backend, extra=SERVER_OPTIONS)
            try:
                server.wait_ready()
                log = run_all(args, server.url, ckpt)
            finally:
                server.stop()
    from plot import write_outputs

    write_outputs(log, args.json, args.plot)


if __name__ == "__main__":
    main()
