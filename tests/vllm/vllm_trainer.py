"""A trainer process for the vLLM tests: send a saved state dict into a vLLM server.

Runs with the MAIN venv (no vLLM): wtcore's ``nccl`` trainer engine over gloo, driven through
``HTTPWeightSyncClient`` against the server's RL routes. Prints the round's stats as one JSON line.

``--stall-after K`` makes the source stop after its K-th tensor (with small buckets, earlier
buckets are already on the wire): it writes ``--ready-file`` and sleeps until the test kills
this process, which is how a test fails a round midway.

``--hf-model DIR`` sends ``ModuleSource(model)`` of transformers' model loaded from DIR instead
of a saved state dict (what a trainer naturally sends: ``named_parameters()``, so a tied
weight once); it needs transformers, so run it with the vLLM venv's Python. ``--omit NAME``
leaves one tensor out of the round.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from wtcore import ModuleSource, TensorSource, WeightTransferTrainerFactory
from wtcore.meta import ParamMeta
from wtcore.source import WeightSource
from wtcore.trainer import TrainerInitInfo
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_nccl import NCCLTrainerInitInfo


class StallingSource(WeightSource):
    """Yields the first ``after`` tensors, then announces it and waits to be killed."""

    def __init__(self, inner: WeightSource, after: int, ready_file: Path) -> None:
        self.inner, self.after, self.ready_file = inner, after, ready_file

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.after:
                self.ready_file.write_text("stalled")
                time.sleep(600)  # the test kills this process long before
            yield item


class OmittingSource(WeightSource):
    """The inner source without one tensor (a round that leaves a layer incomplete)."""

    def __init__(self, inner: WeightSource, omit: str) -> None:
        self.inner, self.omit = inner, omit
        assert any(m.name == omit for m in inner.metadata()), f"no tensor named {omit!r}"

    def metadata(self) -> list[ParamMeta]:
        return [m for m in self.inner.metadata() if m.name != self.omit]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in self.inner if n != self.omit)


def module_source(model_dir: str) -> WeightSource:
    from transformers import AutoModelForCausalLM  # the vLLM venv has it; the main one not

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return ModuleSource(model)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--state", help="torch.save'd {name: tensor}")
    src.add_argument("--hf-model", help="a checkpoint folder: send ModuleSource(model)")
    p.add_argument("--port", type=int, required=True, help="rendezvous port hosted here")
    p.add_argument("--version", default=None)
    p.add_argument("--buffer-bytes", type=int, default=64 << 10)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--stall-after", type=int, default=None)
    p.add_argument("--ready-file", default=None)
    p.add_argument("--omit", default=None, help="leave this tensor out of the round")
    p.add_argument("--backend", choices=("nccl", "ipc", "mooncake"), default="nccl")
    args = p.parse_args()

    source: WeightSource
    if args.hf_model is not None:
        source = module_source(args.hf_model)
    else:
        source = TensorSource(torch.load(args.state, weights_only=True))
    if args.omit is not None:
        source = OmittingSource(source, args.omit)
    if args.stall_after is not None:
        source = StallingSource(source, args.stall_after, Path(args.ready_file))
    info: TrainerInitInfo = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=args.port,
        world_size=2,  # this sender plus the server's one worker
        packed_buffer_size_bytes=args.buffer_bytes,
        packed_num_buffers=2,
        timeout_s=args.timeout_s,
        torch_num_threads=1,
        rank=0,
    )
    if args.backend == "ipc":  # same host: the server maps what this trainer writes
        from wtcore_ipc import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(timeout_s=args.timeout_s, rank=0)
    if args.backend == "mooncake":  # the server reads each bucket from this trainer's staging
        from wtcore_mooncake import MooncakeTrainerInitInfo

        info = MooncakeTrainerInitInfo(
            packed_buffer_size_bytes=args.buffer_bytes, timeout_s=args.timeout_s, rank=0
        )
    with HTTPWeightSyncClient(args.url, timeout_s=args.timeout_s) as client:
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        try:
            stats = trainer.send_weights(weight_version=args.version)
        finally:
            trainer.shutdown()
    print(json.dumps({"num_tensors": stats.num_tensors, "num_bytes": stats.num_bytes}))


if __name__ == "__main__":
    main()
