"""docs/sharded.md's two-process example as it stands: its checkpoint block, its ``wtcore serve``
lines as real processes (on free ports: the page's are fixed) holding TP slices, and its
FSDP2 trainer script as two torchrun ranks (a real gloo group, ``fully_shard`` on a CPU mesh),
over ``tcp`` (one stream per trainer rank and receiver).

The receivers start from the very checkpoint the trainer sends, so their weights are zeroed
first (``weight_checker reset``, as ``wtcore check`` does): each must then hold exactly its
slice (its checksums), report the round published and consistent, and have landed exactly its
slice's bytes; each trainer rank must report that it sent exactly its planned bytes.
"""

from __future__ import annotations

import contextlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs.test_code_blocks import ROOT, _commands, blocks
from wtcore.digest import digest_named
from wtcore.sharded.receiver_layout import TPLayout
from wtcore.testing import torchrun

pytestmark = pytest.mark.processes

PAGE = ROOT / "docs" / "sharded.md"
RULES = (("0.*", "column"), ("1.weight", "row"))  # the page's


@pytest.mark.timeout(300)
def test_the_pages_serve_receivers_and_fsdp2_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file
    pytest.importorskip("wtcore_tcp")
    from wtcore_bench.serve import launch_serve
    from wtcore_http_client import HTTPWeightSyncClient

    page = blocks([PAGE])
    (checkpoint,) = [b for b in page if b.first.startswith("# checkpoint.py")]
    (trainer,) = [b for b in page if b.lang == "python" and b.first == "import gc"]
    (console,) = [b for b in page if b.lang == "console" and "wtcore serve" in b.code]
    commands = [argv for _, argv in _commands(console)]
    serves = [argv[2:] for argv in commands if argv[:2] == ["wtcore", "serve"]]
    assert len(serves) == 2 and commands[2][:3] == ["torchrun", "--nproc-per-node", "2"]
    assert "fully_shard(model, mesh=mesh)" in trainer.code

    monkeypatch.chdir(tmp_path)  # the page's relative paths; the servers inherit it
    exec(compile(checkpoint.code, checkpoint.where, "exec"), {"__name__": "checkpoint"})
    full = load_file("model.safetensors")
    layouts = [TPLayout(r, 2, RULES) for r in range(2)]
    script = tmp_path / "trainer.py"
    script.write_text(trainer.code)
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:  # both start at once, each on a free port
            started = [
                pool.submit(
                    launch_serve,
                    a[: a.index("--port")] + a[a.index("--port") + 2 :],
                    workdir=tmp_path,
                )
                for a in serves
            ]
        for f in started:  # every one that started is stopped by PID, whatever happens
            if f.exception() is None:
                stack.callback(f.result().stop)
        servers = [f.result() for f in started]
        urls = [s.url for s in servers]
        client = stack.enter_context(HTTPWeightSyncClient(urls, timeout_s=60))
        assert [i["layout"] for i in client.weight_info()] == [lay.to_wire() for lay in layouts]
        client.weight_checker("reset")
        ranks = torchrun([sys.executable, str(script)], 2, env={"RECEIVERS": ",".join(urls)})
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
        for r in ranks:
            m = re.search(r"trainer rank (\d): sent (\d+) bytes, its planned (\d+)", r.stdout)
            assert m and m.group(2) == m.group(3), r.stdout
            sent[int(m.group(1))] = int(m.group(2))
        slices = [{n: lay.local(n, t) for n, t in full.items()} for lay in layouts]
        assert client.checksums() == [digest_named(s.items()) for s in slices]
        for info, held in zip(client.weight_info(), slices, strict=True):
            nbytes = sum(t.nbytes for t in held.values())
            assert info["weight_version"] == "step-1" and info["consistent"], info
            assert info["round_bytes"] == {"planned": nbytes, "landed": nbytes}, info
        # every receiver's slice in all, each rank sending its own shards' part of it
        assert sum(sent.values()) == sum(t.nbytes for s in slices for t in s.values())
        assert min(sent.values()) > 0, sent
        for server in servers:
            assert server.stop() == 0, server.output()
