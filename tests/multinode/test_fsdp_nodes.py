"""A 2-rank FSDP2 trainer on 2 nodes sends to receivers on 2 more: nodes 0 and 1 train, 2 and 3 serve.

The trainer ranks (``fsdp_trainer.py``) form their own gloo group across nodes 0 and 1 and hold
the model as DTensor shards (``fully_shard``); each round both gather every tensor in lockstep
and rank 0 alone sends it, through the nccl engine (gloo), to ``wtcore serve --backend nccl``
on nodes 2 and 3. The expected weights are computed here, independently of the trainers, so a
shard gathered in the wrong order, a rank that skipped its update, or a torn round all fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multinode.fsdp_trainer import model_state
from tests.multinode.mn_kit import (
    API_KEY,
    MASTER_PORT,
    START_TIMEOUT_S,
    Receiver,
    node_env,
    start_receivers,
)
from wtcore.digest import digest_named
from wtcore_bench.netns import Cluster
from wtcore_http_client.safetensors import save_safetensors

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
SIZE, TENSORS, ROUNDS = 256 << 10, 12, 3
GROUP_PORT = 29500  # the trainers' own gloo group, hosted on node 0 beside MASTER_PORT
ARGS = ["--backend", "nccl", "--backend-options", '{"torch_num_threads": 1}']


def expected_digests(rounds: int) -> dict[str, str]:
    """The full model after ``rounds`` steps, computed without any sharding."""
    state = model_state(SIZE, TENSORS, seed=0)
    for r in range(1, rounds + 1):
        delta = model_state(SIZE, TENSORS, seed=100 + r)
        for name in state:
            state[name] = state[name] + delta[name]
    return digest_named(state.items())


@pytest.fixture(scope="module")
def net(
    make_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Cluster, list[Receiver], Path]]:
    c: Cluster = make_cluster(4)
    tmp = tmp_path_factory.mktemp("fsdp")
    model = tmp / "model.safetensors"  # the receivers' model: same names, other values
    save_safetensors(model_state(SIZE, TENSORS, seed=7), model)
    receivers = start_receivers(c.nodes[2:4], [*ARGS, "--safetensors", str(model)], tmp)
    yield c, receivers, tmp


def test_two_rank_fsdp_trainer_on_two_nodes_sends_bit_exact(net: Any) -> None:
    c, receivers, tmp = net
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    for rank in (0, 1):
        cfg = {
            "rank": rank, "group_address": c[0].address, "group_port": GROUP_PORT,
            "master_address": c[0].address, "master_port": MASTER_PORT,
            "urls": [r.url for r in receivers], "api_key": API_KEY, "rounds": ROUNDS,
            "size": SIZE, "tensors": TENSORS, "timeout": 60.0,
        }  # fmt: skip
        path = tmp / f"rank{rank}.json"
        path.write_text(json.dumps(cfg))
        out, err = tmp / f"rank{rank}.out", tmp / f"rank{rank}.err"
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = c[rank].popen([sys.executable, str(HERE / "fsdp_trainer.py"), str(path)],
                                 env=node_env(GLOO_SOCKET_IFNAME="eth0"), stdout=o, stderr=e,
                                 stdin=subprocess.DEVNULL)  # fmt: skip
        procs.append((proc, out, err))
    deadline = time.monotonic() + START_TIMEOUT_S + 60  # imports, then a few seconds of rounds
    for proc, out, err in procs:
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        assert proc.returncode == 0, (
            f"trainer failed:\n{out.read_text()}\n{err.read_text()[-6000:]}"
        )
    lines = [[json.loads(ln) for ln in out.read_text().splitlines() if ln.startswith("{")]
             for _, out, _ in procs]  # fmt: skip
    # Both ranks hold DTensor shards that together are the model, each strictly a part of it.
    shards = [rank_lines[0] for rank_lines in lines]
    assert all(s["dtensors"] for s in shards), shards
    assert sum(s["local_numel"] for s in shards) == shards[0]["global_numel"], shards
    assert all(0 < s["local_numel"] < s["global_numel"] for s in shards), shards
    # Rank 1 took part in every round (it gathered every tensor) but sent nothing itself.
    assert [(ln["round"], ln["tensors"]) for ln in lines[1][1:]] == [
        (r, TENSORS + 2) for r in range(1, ROUNDS + 1)
    ]
    for ln in lines[0][1:]:
        r = ln["round"]
        assert ln["checksums"] == [expected_digests(r)] * 2, f"round {r} is not bit-exact"
        assert ln["infos"] == [[f"r{r}", True]] * 2
