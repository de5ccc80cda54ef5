"""One rank of a 2-rank FSDP2 trainer (gloo, CPU), run inside a namespaced node.

Argument: a JSON file with this rank's settings (``rank``, ``group_address``/``group_port`` of
the trainers' own gloo group, the transfer group's ``master_address``/``master_port``, the
receivers' ``urls`` and ``api_key``, ``rounds``, ``size``, ``tensors``, ``timeout``).

Both ranks build ``model_state(size, tensors, seed=0)`` as a module and shard it with
``fully_shard`` (every parameter becomes a DTensor holding this rank's rows; odd row counts
give uneven and empty shards), then run ``rounds`` rounds: a stand-in training step adds
``model_state(..., seed=100 + round)`` to every parameter, shard by shard, and both ranks call ``send_weights`` in lockstep. Gathering
the full tensors is a collective of the two ranks; only rank 0 (the sender) has a client and
joins the transfer group with the receivers. Each rank prints one JSON line per round; rank 0's
carries every receiver's ``checksums()`` and ``weight_info()`` after that round.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from wtcore import ModuleSource, WeightTransferTrainerFactory
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_kit.synthetic import build_module, synthetic_state
from wtcore_nccl import NCCLTrainerInitInfo


def model_state(size: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    """``synthetic_state`` plus tensors whose rows do not split evenly over 2 ranks."""
    state = synthetic_state(size, tensors, "float32", seed=seed)
    g = torch.Generator().manual_seed(seed)
    state["head.odd.weight"] = torch.randn(5, 3, generator=g)  # shards of 3 and 2 rows
    state["head.odd.bias"] = torch.randn(1, generator=g)  # rank 1's shard is empty
    return state


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg: dict[str, Any] = json.load(f)
    rank, timeout = cfg["rank"], cfg["timeout"]
    torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=timeout)
    # The group's store, ours: it outlives the group, so that rank 0 (its host) can stay up
    # until rank 1 has torn the group down (see the end of main).
    store = dist.TCPStore(cfg["group_address"], cfg["group_port"], 2, rank == 0, wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=wait)
    mesh = init_device_mesh("cpu", (2,))
    model = build_module(model_state(cfg["size"], cfg["tensors"], seed=0))
    fully_shard(model, mesh=mesh)
    params = list(model.named_parameters())
    shards = {
        "rank": rank,
        "dtensors": all(isinstance(p, DTensor) for _, p in params),
        "local_numel": sum(p.to_local().numel() for _, p in params),  # type: ignore[attr-defined]
        "global_numel": sum(p.numel() for _, p in params),
    }
    print(json.dumps(shards), flush=True)

    client = None
    if rank == 0:
        client = HTTPWeightSyncClient(cfg["urls"], api_key=cfg["api_key"], timeout_s=timeout)
    info = NCCLTrainerInitInfo(
        rank=rank,
        master_address=cfg["master_address"],
        master_port=cfg["master_port"],
        world_size=1 + len(cfg["urls"]),
        timeout_s=timeout,
        torch_num_threads=1,
    )
    with WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    ) as trainer:
        for r in range(1, cfg["rounds"] + 1):
            delta = model_state(cfg["size"], cfg["tensors"], seed=100 + r)
            with torch.no_grad():  # stands in for an optimizer step, on this rank's shards only
                for name, p in params:
                    d = distribute_tensor(delta[name], mesh, p.placements, src_data_rank=None)  # type: ignore[attr-defined]
                    p.add_(d)
            stats = trainer.send_weights(weight_version=f"r{r}")
            line: dict[str, Any] = {"round": r, "rank": rank, "tensors": stats.num_tensors}
            if client is not None:
                line["checksums"] = client.checksums()
                line["infos"] = [
                    (i["weight_version"], i["consistent"]) for i in client.weight_info()
                ]
            print(json.dumps(line), flush=True)
    if client is not None:
        client.close()
    # Rank 0 hosts the store, and a rank still tearing the group down after the host exited
    # can abort in gloo's teardown (seen twice under CI load, after a barrier here): so rank 1
    # says when it is done, and rank 0 waits for that before it exits.
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        store.set("rank1-left", "1")
    else:
        store.wait(["rank1-left"], wait)


if __name__ == "__main__":
    main()
