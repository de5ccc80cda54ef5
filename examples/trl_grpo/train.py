"""TRL's GRPOTrainer against a real vLLM CPU server, syncing through wtcore (``wtcore-trl``).

Runs with the vLLM venv's Python (TRL's vLLM client needs vLLM installed):

    .venv-vllm/bin/python examples/trl_grpo/train.py --json trl.json --plot trl.png

Runs of ``--steps`` GRPO steps each, every one from the same initial policy (``--runs``: the
first three by default, all five in ``make trl-demo``):

- ``control``: wtcore syncs the initial weights once, at step 0, and never again, so vLLM keeps
  sampling from the initial policy while the trainer's copy moves away from it;
- ``synced``: the lines of docs/trl.md, run as they stand there (``wtcore_trl.install``,
  ``GRPOTrainer``, ``wtcore_trl.follow``): every step's weights reach vLLM;
- ``delta``: the same with ``delta=True``;
- ``merged``: the LoRA lines of docs/trl.md without ``lora=``: a PEFT adapter trained, and TRL
  merges it into the base to sync the whole model, every step;
- ``lora``: those lines as they stand: each sync sends the adapter alone, and vLLM generates
  with it under the name ``policy`` (the server needs LoRA enabled; without ``--url`` it is).

After every step it reads the server's ``/weight_info`` version, and it takes TRL's own
measure of the training-inference mismatch, ``sampling/sampling_logp_difference/{mean,max}``
(the trainer's logprobs of vLLM's sampled tokens against vLLM's). Without ``--url`` it builds the
tiny checkpoint of the vLLM tests (nothing downloaded) and starts one vLLM server with
``wtcore_nccl``; with ``--url`` and ``--checkpoint`` it uses a server already serving that
checkpoint (the CI test does this).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The vLLM tests' checkpoint and server, and the RL loop's plot, shared rather than copied.
sys.path[:0] = [str(ROOT / "examples" / "rl_loop"), str(ROOT / "tests" / "vllm")]

RUNS = ("control", "synced", "delta", "merged", "lora")
#: What TRL asks of the server beyond the RL routes: logprobs after temperature and penalties,
#: the ones its importance-sampling correction compares with (at temperature 1 without
#: penalties, the CI test's setting, they equal the raw ones).
TRL_SERVER_FLAGS = ("--logprobs-mode", "processed_logprobs")
#: What the ``lora`` run asks of the server (docs/vllm.md): LoRA enabled, a resolver folder.
LORA_SERVER_FLAGS = ("--enable-lora", "--max-lora-rank", "8")
DOC = ROOT / "docs" / "trl.md"
#: Prompts in the tiny checkpoint's word-level vocabulary (``w<i>``).
PROMPTS = ["w5 w6 w7 w8", "w100 w3 w42", "w250 w17 w17 w9 w200 w31", "w60 w61"]
#: The words the reward counts: ``w0`` .. ``w31``.
TARGETS = frozenset(f"w{i}" for i in range(32))


def reward(completions: list[str], **_: Any) -> list[float]:
    """The share of a completion's words that are target words (anyone can check it)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w in TARGETS for w in words) / max(1, len(words)))
    return out


def doc_lines(first: str) -> str:
    """The python block of docs/trl.md that starts with ``first``: the lines a user writes, run
    here as they stand."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
    found = [b for b in blocks if b.startswith(first)]
    assert len(found) == 1, f"{DOC}: expected one python block starting {first!r}"
    return str(found[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a vLLM server serving --checkpoint with wtcore_nccl")
    p.add_argument("--checkpoint", type=Path, help="the checkpoint folder that server serves")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default=",".join(RUNS[:3]), help="which runs, in order")
    p.add_argument("--json", type=Path, help="write every step of every run here")
    p.add_argument("--plot", type=Path, help="draw reward, mismatch and sync time here (PNG)")
    p.add_argument(
        "--adapter-dir",
        type=Path,
        help="after the lora run, sync its adapter once more and save it here (PEFT's folder)",
    )
    return p.parse_args(argv)


def one_run(
    run: str, args: argparse.Namespace, url: str, checkpoint: Path, out: Path
) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    import wtcore_trl
    from wtcore.testing.net import free_port

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 64})
    config = GRPOConfig(
        output_dir=str(out / run),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_group_port=free_port(),  # the rendezvous this trainer hosts for the server
        use_cpu=True,
        bf16=False,
        learning_rate=args.lr,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=12,
        max_steps=args.steps,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    records: list[dict[str, Any]] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        """After each step: the server's version, this step's sync and its time."""

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            import requests

            info = requests.get(url + "/weight_info", timeout=60).json()
            syncs = namespace["trainer"].vllm_generation.vllm_client.syncs
            records.append(
                {
                    "step": state.global_step - 1,  # the step whose weights were synced first
                    "vllm_version": info["weight_version"],
                    "syncs": len(syncs),
                    "sync_s": syncs[-1].seconds if len(syncs) == state.global_step else 0.0,
                    "sync_bytes": syncs[-1].num_bytes if len(syncs) == state.global_step else 0,
                    "step_s": time.perf_counter() - self.t0,
                }
            )

    namespace: dict[str, Any] = {
        "SERVER_URL": url,
        "model": model,
        "tokenizer": tokenizer,
        "dataset": dataset,
        "reward": reward,
        "config": config,
        "Record": Record,
    }
    code = doc_lines("from peft" if run in ("merged", "lora") else "import wtcore_trl")
    code = code.replace("trainer.train()", "trainer.add_callback(Record())\ntrainer.train()")
    if run == "merged":
        code = code.replace(
            'follow(trainer, lora=LoRASource(trainer.model, "policy"))', "follow(trainer)"
        )
        assert "lora=" not in code, f"{DOC}: the LoRA block's follow line changed"
    if run == "lora":  # its syncs leave the base alone: the initial one first, as step 0 does
        restore = wtcore_trl.install(backend="nccl")(base_url=url, group_port=free_port())
        restore.init_communicator(device="cpu")
        try:
            restore.update_model_params(model)
        finally:
            restore.close_communicator()
    if run == "delta":
        code = code.replace('install(backend="nccl")', 'install(backend="nccl", delta=True)')
    if run == "control":
        cls = wtcore_trl.install(backend="nccl")

        class OnlyFirst(cls):  # type: ignore[misc, valid-type]
            """Syncs the initial weights (step 0), then never again."""

            def update_named_params(self, metadata: Any, named_params: Any) -> None:
                if not self.syncs:
                    super().update_named_params(metadata, named_params)

        code = code.replace('wtcore_trl.install(backend="nccl")', "VLLMGen.VLLMClient = OnlyFirst")
        import trl.generation.vllm_generation as vllm_gen

        namespace |= {"VLLMGen": vllm_gen, "OnlyFirst": OnlyFirst}
    start = time.perf_counter()
    exec(compile(code, f"{DOC} ({run})", "exec"), namespace)
    wall = time.perf_counter() - start
    trainer = namespace["trainer"]
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    for rec, log in zip(records, logs, strict=True):
        rec["reward"] = float(log["reward"])
        rec["mismatch_mean"] = float(log["sampling/sampling_logp_difference/mean"])
        rec["mismatch_max"] = float(log["sampling/sampling_logp_difference/max"])
        print(
            f"{run:7s} step {rec['step']:2d}/{args.steps}  reward {rec['reward']:.3f}  "
            f"mismatch {rec['mismatch_mean']:.2e} (max {rec['mismatch_max']:.2e})  "
            f"sync {rec['sync_s']:.2f} s ({rec['sync_s'] / rec['step_s']:4.0%} of "
            f"{rec['step_s']:.2f} s, {rec['sync_bytes']} B)  vllm version {rec['vllm_version']}",
            flush=True,
        )
    if run == "lora" and args.adapter_dir is not None:  # what the server serves, and PEFT's save
        trainer.vllm_generation.sync_weights()
        trainer.model.save_pretrained(args.adapter_dir)
    trainer.vllm_generation.vllm_client.close_communicator()
    return {"sync": run != "control", "wall_s": wall, "steps": records}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log: dict[str, Any] = {
        "config": {
            "backend": "nccl",
            "group_size": 8,
            "lr": args.lr,
            "seed": args.seed,
            "title": "TRL GRPOTrainer through wtcore-trl",
            "sync_label": "update_named_params (the sync)",
        },
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="wtcore-trl-") as tmp:
        server = None
        if args.url is not None:
            url, checkpoint = args.url.rstrip("/"), args.checkpoint
        else:
            from make_checkpoint import main as make_checkpoint
            from vllm_kit import VLLMServer

            checkpoint = Path(tmp) / "policy"
            make_checkpoint(str(checkpoint), str(Path(tmp) / "policy.pt"), 1)
            log_path = Path(tmp) / "vllm.log"
            print(f"starting vLLM (CPU) on the tiny policy; its log: {log_path}", flush=True)
            extra, env = list(TRL_SERVER_FLAGS), {}
            if "lora" in args.runs.split(","):
                (Path(tmp) / "lora").mkdir()
                extra += LORA_SERVER_FLAGS
                env = {
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                    "VLLM_LORA_RESOLVER_CACHE_DIR": str(Path(tmp) / "lora"),
                }
            server = VLLMServer.start(
                checkpoint, log_path, backend="wtcore_nccl", extra=extra, env=env
            )
            server.wait_ready()
            url = server.url
        try:
            for run in args.runs.split(","):
                log["runs"][run] = one_run(run, args, url, checkpoint, Path(tmp))
        finally:
            if server is not None:
                server.stop()
    from plot import write_outputs

    write_outputs(log, args.json, args.plot)


if __name__ == "__main__":
    main()
