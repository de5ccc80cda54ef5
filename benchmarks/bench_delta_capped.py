"""Delta rounds against full rounds on links capped at a rate (default 1 Gbit/s), real steps.

Needs root and iproute2 (network namespaces, ``tc``): three namespaced nodes on one bridge,
every node's link capped (``wtcore_bench.netns``). Node 0 runs two nccl trainers (gloo)
over HTTP, one with ``delta=True``; node 1 serves the delta trainer's receiver and node 2 the
full trainer's (``wtcore serve``). Both get the same weights every round, in alternating
order, never at the same time: the real training steps of
:func:`wtcore.testing.realistic.realistic_steps`, then rounds where every element changes.
Every round is checked (the receivers' checksums against the trainer's weights).

    .venv/bin/python benchmarks/bench_delta_capped.py --rate 1gbit --json out.json  # as root
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

API_KEY = "bench-delta-key"
PORT = 8100
MASTER_PORTS = {"delta": 29611, "full": 29612}
WIDTH, STEPS, DENSE, BUCKET_MIB = 256, 8, 6, 4
#: AdamW's learning rate for the real steps; RL post-training commonly runs at 1e-6 to 1e-5.
LR = 1e-5


def _states(width: int, steps: int, dense: int, lr: float = LR) -> list[dict[str, Any]]:
    from wtcore.testing.realistic import realistic_steps
    from wtcore_delta.codec import bits

    states = realistic_steps(steps, d_model=width, layers=4, vocab=8192, seq=64, batch=4, lr=lr)
    for _ in range(dense):
        new = {n: t.clone() for n, t in states[-1].items()}
        for t in new.values():
            b = bits(t)
            b.copy_(b ^ 1)
        states.append(new)
    return states


def driver(args: argparse.Namespace) -> None:
    """In node 0: both trainers, every round; one JSON line on stdout."""
    import torch

    from wtcore import TensorSource, WeightTransferTrainerFactory
    from wtcore.digest import digest_named
    from wtcore.testing.realistic import changed_fraction
    from wtcore_http_client import HTTPWeightSyncClient
    from wtcore_nccl import NCCLTrainerInitInfo

    torch.set_num_threads(1)
    states = _states(args.width, args.steps, args.dense, args.lr)
    live = {n: t.clone() for n, t in states[0].items()}
    source = TensorSource(live)
    urls = json.loads(args.urls)
    trainers = {}
    for kind in ("delta", "full"):
        client = HTTPWeightSyncClient(urls[kind], api_key=API_KEY, timeout_s=120)
        info = NCCLTrainerInitInfo(
            master_address=args.address,
            master_port=MASTER_PORTS[kind],
            world_size=2,
            timeout_s=120.0,
            torch_num_threads=1,
            delta=("auto" if args.auto else True) if kind == "delta" else False,
            rank=0,
            packed_buffer_size_bytes=args.bucket_mib << 20,
        )
        trainers[kind] = (WeightTransferTrainerFactory.trainer_init(info, client=client), client)
    rounds = []
    for r, new in enumerate(states):
        for n, t in live.items():
            t.copy_(new[n])
        want = digest_named(live.items())
        row: dict[str, Any] = {
            "round": r,
            "kind": "initial" if r == 0 else ("real step" if r <= args.steps else "dense"),
            "changed_fraction": 1.0 if r == 0 else changed_fraction(states[r - 1], new),
        }
        for kind in ("delta", "full") if r % 2 else ("full", "delta"):
            trainer, client = trainers[kind]
            stats = trainer.send_weights(source, weight_version=f"r{r}")
            if client.checksums() != [want]:
                raise SystemExit(f"round {r}: the {kind} receiver differs from the trainer")
            row[f"{kind}_bytes"], row[f"{kind}_seconds"] = stats.num_bytes, stats.seconds
            if stats.delta is not None:
                row["mode"], row["base_copies"] = stats.delta["mode"], stats.delta["base_copies"]
                row["check_seconds"] = stats.delta["check_seconds"]
                row["encode_seconds"] = stats.delta["encode_seconds"]
        rounds.append(row)
    for trainer, client in trainers.values():
        trainer.shutdown()
        client.close()
    print(json.dumps({"rounds": rounds}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit", help="tc rate of every node's link")
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--dense", type=int, default=DENSE)
    p.add_argument("--lr", type=float, default=LR, help="AdamW's learning rate for the steps")
    p.add_argument(
        "--bucket-mib",
        type=int,
        default=BUCKET_MIB,
        help="both trainers' packed_buffer_size_bytes, in MiB: several buckets per round let "
        "the receiver load one bucket while the next is on the wire",
    )
    p.add_argument("--auto", action="store_true", help="the delta trainer uses delta='auto'")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--urls", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.driver:
        driver(args)
        return
    from wtcore_bench.netns import cluster, unavailable_reason
    from wtcore_http_client.safetensors import save_safetensors

    why = unavailable_reason()
    if why:
        raise SystemExit(f"bench_delta_capped: {why}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WTCORE_API_KEY", None)
    with (
        tempfile.TemporaryDirectory() as tmp,
        cluster(3, rate=args.rate, subnet="10.217.0.0/24") as c,
    ):
        model = Path(tmp) / "model.safetensors"
        save_safetensors(_states(args.width, 0, 0)[0], model)
        urls: dict[str, str] = {}
        servers = []
        for kind, node in (("delta", c[1]), ("full", c[2])):
            out = open(Path(tmp) / f"{kind}.log", "wb")  # noqa: SIM115 (closed with the dir)
            argv = [
                sys.executable, "-m", "wtcore.cli", "serve", "--backend", "nccl",
                "--backend-options", '{"torch_num_threads": 1}', "--host", node.address,
                "--port", str(PORT), "--api-key", API_KEY, "--safetensors", str(model),
            ]  # fmt: skip
            servers.append((node.popen(argv, env=env, stdout=out, stderr=out), out.name))
            urls[kind] = f"http://{node.address}:{PORT}"
        deadline = time.monotonic() + 180
        for proc, log in servers:
            while "listening on" not in Path(log).read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"wtcore serve did not start:\n{Path(log).read_text()}")
                time.sleep(0.1)
        argv = [
            sys.executable, __file__, "--driver", "--address", c[0].address,
            "--urls", json.dumps(urls), "--width", str(args.width), "--steps", str(args.steps),
            "--dense", str(args.dense), "--bucket-mib", str(args.bucket_mib),
            "--lr", repr(args.lr), *(["--auto"] if args.auto else []),
        ]  # fmt: skip
        drv = c[0].popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = drv.communicate(timeout=1200)
        if drv.returncode != 0:
            raise SystemExit(f"driver failed ({drv.returncode}):\n{stderr[-4000:]}")
    record = json.loads(stdout.strip().splitlines()[-1])
    record["settings"] = {
        "rate": args.rate,
        "width": args.width,
        "steps": args.steps,
        "lr": args.lr,
        "bucket_mib": args.bucket_mib,
        "auto": args.auto,
    }
    _print(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))


def _print(record: dict[str, Any]) -> None:
    print(f"delta vs full, nccl over HTTP, links capped at {record['settings']['rate']}")
    print(f"{'round':>5} {'kind':<10} {'changed':>8} {'mode':<6} {'delta MiB':>10} "
          f"{'full MiB':>9} {'delta s':>8} {'full s':>8} {'speedup':>8} {'copies':>6} "
          f"{'check ms':>8} {'encode ms':>9}")  # fmt: skip
    for x in record["rounds"]:
        print(f"{x['round']:>5} {x['kind']:<10} {x['changed_fraction']:>8.2%} {x['mode']:<6} "
              f"{x['delta_bytes'] / 2**20:>10.3f} {x['full_bytes'] / 2**20:>9.3f} "
              f"{x['delta_seconds']:>8.4f} {x['full_seconds']:>8.4f} "
              f"{x['full_seconds'] / x['delta_seconds']:>8.2f} {x['base_copies']:>6} "
              f"{x['check_seconds'] * 1e3:>8.1f} {x['encode_seconds'] * 1e3:>9.1f}")  # fmt: skip
    for kind in ("real step", "dense"):
        rows = [x for x in record["rounds"] if x["kind"] == kind and not x.get("base_copies")]
        if rows:
            sp = statistics.median(x["full_seconds"] / x["delta_seconds"] for x in rows)
            print(f"{kind}: median speedup {sp:.2f}x over {len(rows)} rounds")


if __name__ == "__main__":
    main()
