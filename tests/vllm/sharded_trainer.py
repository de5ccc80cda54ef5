"""One rank of an FSDP2 trainer for the vLLM tests: send a saved state dict, sharded, into a
vLLM server (``wtcore_tcp``), no rank ever gathering a tensor.

Runs with the MAIN venv (no vLLM), once per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` as torchrun sets them): the state becomes a module, ``fully_shard`` spreads it
over a CPU mesh of every rank, and each rank sends its own shards with ``ShardedModuleSource``
(``DTensor.full_tensor`` is made to fail, so a gather anywhere fails the round). Rank 0 alone
holds an HTTP client (with ``--tp N`` > 1, :class:`wtcore_http_client.VLLMWeightSyncClient`,
which reads each TP worker's layout). Prints one JSON line per rank: its bytes sent and
planned.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from wtcore.sharded import ShardedModuleSource
from wtcore.source import ModuleSource
from wtcore_http_client import HTTPWeightSyncClient, VLLMWeightSyncClient
from wtcore_kit.synthetic import build_module
from wtcore_tcp import TCPTrainerEngine, TCPTrainerInitInfo


def _no_gather(self: Any) -> Any:
    raise AssertionError("full_tensor() was called: a rank gathered a tensor")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--state", required=True, help="torch.save'd {name: tensor}")
    p.add_argument("--version", required=True)
    p.add_argument("--buffer-bytes", type=int, default=64 << 10)
    p.add_argument("--tp", type=int, default=1, help="the server's tensor_parallel_size")
    p.add_argument("--omit", action="append", default=[], help="leave this tensor out")
    p.add_argument(
        "--whole", action="store_true", help="one rank, ModuleSource: whole tensors, no plan"
    )
    p.add_argument("--staged", action="store_true", help="a staged round (docs/staged.md)")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state = torch.load(args.state, weights_only=True)
        model = build_module({n: t for n, t in state.items() if n not in args.omit})
        if not args.whole:
            fully_shard(model, mesh=mesh)
        DTensor.full_tensor = _no_gather  # type: ignore[method-assign]
        rank = dist.get_rank()
        client_cls = HTTPWeightSyncClient if args.tp == 1 else VLLMWeightSyncClient
        client = client_cls(args.url, timeout_s=120) if rank == 0 else None
        info = TCPTrainerInitInfo(
            address="127.0.0.1",  # where this rank listens for the server's worker
            world_size=1 + args.tp,  # rank 0 plus the server's workers
            rank=rank,
            packed_buffer_size_bytes=args.buffer_bytes,
            timeout_s=120.0,
            staged=args.staged,
        )
        engine = TCPTrainerEngine.trainer_init(info, client=client)
        try:
            source = ModuleSource(model) if args.whole else ShardedModuleSource(model)
            stats = engine.send_weights(source, weight_version=args.version)
        finally:
            engine.shutdown()
            if client is not None:
                client.close()
        out = {"rank": rank, "sent": stats.bytes_sent, "planned": stats.num_bytes}
        print(json.dumps(out), flush=True)
        del model  # FSDP's reference cycles hold the mesh's groups: free them first
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Past its last line, torch's teardown at interpreter exit sometimes aborts a process that
    # used gloo groups ("terminate called without an active exception", rc -6; seen here about
    # once in 15 runs under load, with the FSDP model freed first, as docs/sharded.md's
    # script does): the round is over and reported, so end without finalization, as `wtcore
    # serve` does. A failure inside main() still raises and exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
