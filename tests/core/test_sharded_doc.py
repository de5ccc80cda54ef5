"""docs/sharded.md's trainer script runs as it stands: two FSDP2 trainer processes (a real gloo
group, ``fully_shard`` on a CPU mesh) into two real HTTP receivers holding TP slices, over
``tcp`` (one stream per trainer rank and receiver).

Each receiver must hold exactly its slice of the model the script builds (``torch.equal``),
report the round published and consistent, and have landed exactly its slice's bytes; each
trainer rank must report that it sent exactly its planned bytes.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import pytest
import torch

from wtcore import ModuleSink, WeightSyncWorker
from wtcore.sharded.receiver_layout import TPLayout
from wtcore.testing import torchrun
from wtcore_kit.synthetic import build_module

pytestmark = pytest.mark.processes

PAGE = Path(__file__).resolve().parents[2] / "docs" / "sharded.md"
RULES = (("0.*", "column"), ("1.weight", "row"))  # the page's


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))


def _script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    (script,) = [b for b in blocks if b.startswith("import gc\nimport os")]
    assert "fully_shard(model, mesh=mesh)" in script and "ShardedModuleSource(model)" in script
    return script


@pytest.mark.timeout(300)
def test_the_pages_fsdp2_trainer_syncs_two_tp_receivers(tmp_path: Path) -> None:
    pytest.importorskip("wtcore_http_client")
    pytest.importorskip("wtcore_tcp")
    from wtcore_http_client.routes import ReceiverRoutes
    from wtcore_http_client.server import ReceiverHTTPServer

    full = {n: p.detach().clone() for n, p in _model().named_parameters()}
    layouts = [TPLayout(r, 2, RULES) for r in range(2)]
    fleet = [
        WeightSyncWorker(
            "tcp",
            ModuleSink(
                build_module({n: torch.zeros_like(lay.local(n, t)) for n, t in full.items()}),
                layout=lay,
            ),
            rank=r,
            world_size=2,
        )
        for r, lay in enumerate(layouts)
    ]
    script = tmp_path / "trainer.py"
    script.write_text(_script())
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ReceiverHTTPServer(ReceiverRoutes(w))).url for w in fleet]
        ranks = torchrun([sys.executable, str(script)], 2, env={"RECEIVERS": ",".join(urls)})
        outs = [(r.stdout, r.stderr) for r in ranks]
        for r in ranks:
            # A plain script (not a multiprocessing child, which leaves by os._exit) runs
            # torch's teardown at exit. Seen in CI before the page freed the FSDP model ahead
            # of destroy_process_group (a minimal script reproduces it in about 1 exit of 20,
            # and 0 of 60 with the model freed first): after the script's last line torch
            # aborted ("terminate called without an active exception", rc -6). Kept tolerated
            # until CI has shown it gone; the round itself is checked below, and any other
            # failure, or that abort before the last line, still fails here.
            torn_down = (
                r.returncode == -6
                and "trainer rank" in r.stdout
                and r.stderr.strip().endswith("terminate called without an active exception")
            )
            assert r.returncode == 0 or torn_down, r.stderr[-3000:]
        sent = {}
        for out, _ in outs:
            m = re.search(r"trainer rank (\d): sent (\d+) bytes, its planned (\d+)", out)
            assert m, out
            assert m.group(2) == m.group(3), out
            sent[int(m.group(1))] = int(m.group(2))
        for r, (w, lay) in enumerate(zip(fleet, layouts, strict=True)):
            info = w.weight_info()
            assert info["weight_version"] == "step-1" and info["consistent"], info
            want = {n: lay.local(n, t) for n, t in full.items()}
            nbytes = sum(t.nbytes for t in want.values())
            assert info["round_bytes"] == {"planned": nbytes, "landed": nbytes}, r
            held = dict(w.sink.module.named_parameters())  # type: ignore[attr-defined]
            for n, t in want.items():
                assert torch.equal(held[n], t), (r, n)
        # every receiver's slice in all, each rank sending its own shards' part of it
        total = sum(lay.local(n, t).nbytes for lay in layouts for n, t in full.items())
        assert sum(sent.values()) == total and min(sent.values()) > 0, sent
    for w in fleet:
        w.shutdown()
