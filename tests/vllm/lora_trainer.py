"""A PEFT trainer for the LoRA test: adapter rounds into a vLLM server, and their references.

Runs with the vLLM venv's Python (transformers and PEFT). It starts one wtcore ``nccl`` trainer
(gloo), then reads one JSON round per line on stdin (``seed``, ``rank``, ``targets``, ``ref``,
``version``): it wraps the checkpoint in ``peft.get_peft_model``, gives every LoRA tensor
random, non-zero values (PEFT's own init zeroes ``lora_B``, which would change nothing), saves
the adapter with PEFT's ``save_pretrained`` into ``ref`` (the folder the server loads: the
reference), and sends ``LoRASource(model, --name)``. One JSON line answers each round: its
tensors and bytes, the adapter's (PEFT's state dict) and the base model's (what a merged round
would send), or the round's ``error``. One process for every round: importing PEFT and
transformers is the slow part.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from wtcore import WeightTransferTrainerFactory
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_vllm.lora import LoRASource


def one_round(trainer: Any, model_dir: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(spec["seed"])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged_bytes = sum(t.nbytes for t in base.state_dict().values())
    rank = spec["rank"]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=spec["targets"])
    model = get_peft_model(base, config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if ".lora_" in param_name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(spec["ref"])
    adapter = get_peft_model_state_dict(model)
    try:
        stats = trainer.send_weights(LoRASource(model, name), weight_version=spec["version"])
    except Exception as e:  # the test reads why
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "num_tensors": stats.num_tensors,
        "num_bytes": stats.num_bytes,
        "adapter_tensors": len(adapter),
        "adapter_bytes": sum(t.nbytes for t in adapter.values()),
        "merged_bytes": merged_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--port", type=int, required=True, help="rendezvous port hosted here")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--name", required=True, help="the adapter's name on the server")
    args = p.parse_args()

    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=args.port,
        world_size=2,  # this sender plus the server's one worker
        packed_buffer_size_bytes=64 << 10,
        timeout_s=60.0,
        torch_num_threads=1,
        rank=0,
    )
    with HTTPWeightSyncClient(args.url, timeout_s=60.0) as client:
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client)
        try:
            print(json.dumps({"ready": True}), flush=True)
            for line in sys.stdin:
                out = one_round(trainer, args.model_dir, args.name, json.loads(line))
                print(json.dumps(out), flush=True)
        finally:
            trainer.shutdown()


if __name__ == "__main__":
    main()
