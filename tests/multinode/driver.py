"""The trainer side of the multinode tests, run inside a namespaced node; JSON lines on stdio.

The pytest process lives in the host's network namespace and cannot reach the nodes, so the
trainer (and every HTTP call to the receivers) runs here, in the trainer's node, driven one
command per line on stdin; each command gets one JSON line back on stdout:

- ``{"op": "init", "urls": [...], "api_key": k, "master_address": a, "master_port": p,
  "world_size": n, "timeout_s": t, "size": bytes, "tensors": n, "broadcast": b, "topology": o,
  "backend": e}``: a new trainer, ``nccl`` unless ``backend`` says ``tcp`` (which listens on
  ``master_address``, on a port of its own) or ``mooncake`` (its transfer engine on
  ``master_address``; the receivers read from it); ``broadcast`` (nccl) and ``topology`` (tcp)
  optional: the engine's default, so the fault tests run tcp's chain for two receivers (the
  previous trainer, if any, is shut down first);
- ``{"op": "send", "seed": s, "version": v}``: one round of ``synthetic_state(seed)``;
- ``{"op": "info"}`` / ``{"op": "checksums"}``: every receiver's ``weight_info()`` /
  ``checksums()``, asked one receiver at a time so that a dead one is reported, not raised;
- ``{"op": "close"}``: shut the trainer down; ``{"op": "exit"}``: leave.

Every answer carries ``ok`` and ``elapsed_s``; a failure carries its
:class:`~wtcore.errors.ErrorRecord` (``error``, ``error_type``, ``status``) and a ``traceback``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from typing import Any

from wtcore import TensorSource, WeightTransferTrainerFactory
from wtcore.errors import ErrorRecord
from wtcore.testing.sources import synthetic_state
from wtcore_http_client import HTTPWeightSyncClient
from wtcore_mooncake import MooncakeTrainerInitInfo
from wtcore_nccl import NCCLTrainerInitInfo
from wtcore_tcp import TCPTrainerInitInfo

STATE: dict[str, Any] = {"trainer": None, "client": None, "cmd": None}


def _close() -> None:
    trainer, STATE["trainer"] = STATE["trainer"], None
    if trainer is not None:
        try:
            trainer.shutdown()
        except Exception:  # a failed round already reported its error
            pass
    gc.collect()


def _per_receiver(call: str) -> list[Any]:
    cmd = STATE["cmd"]
    out: list[Any] = []
    for url in cmd["urls"]:
        try:
            with HTTPWeightSyncClient(url, api_key=cmd["api_key"], timeout_s=5) as c:
                [value] = getattr(c, call)()
            out.append(value)
        except Exception as e:
            out.append(ErrorRecord.from_exception(e).to_json())
    return out


def handle(cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    if op == "init":
        _close()
        STATE["cmd"] = cmd
        client = HTTPWeightSyncClient(cmd["urls"], api_key=cmd["api_key"], timeout_s=cmd["timeout"])
        common = {
            "rank": 0,
            "world_size": cmd["world_size"],
            "packed_buffer_size_bytes": cmd.get("buffer_size", 256 << 10),
            "timeout_s": cmd["timeout"],
        }
        info: NCCLTrainerInitInfo | TCPTrainerInitInfo | MooncakeTrainerInitInfo
        if cmd.get("backend", "nccl") == "tcp":
            info = TCPTrainerInitInfo(
                address=cmd["master_address"], topology=cmd.get("topology", "auto"), **common
            )
        elif cmd.get("backend") == "mooncake":
            del common["world_size"]  # pull: the trainer never counts its readers
            info = MooncakeTrainerInitInfo(address=cmd["master_address"], **common)
        else:
            info = NCCLTrainerInitInfo(
                master_address=cmd["master_address"],
                master_port=cmd["master_port"],
                torch_num_threads=1,
                broadcast=cmd.get("broadcast", "auto"),
                **common,
            )
        STATE["trainer"] = WeightTransferTrainerFactory.trainer_init(info, client=client)
        return {}
    if op == "send":
        c = STATE["cmd"]
        state = synthetic_state(c["size"], c["tensors"], "float32", seed=cmd["seed"])
        stats = STATE["trainer"].send_weights(TensorSource(state), weight_version=cmd["version"])
        return {"bytes": int(getattr(stats, "bytes", 0) or 0)}
    if op == "info":
        return {"infos": _per_receiver("weight_info")}
    if op == "checksums":
        return {"checksums": _per_receiver("checksums")}
    if op == "close":
        _close()
        return {}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        t0 = time.monotonic()
        try:
            answer = {"ok": True, **handle(cmd)}
        except Exception as e:
            answer = {
                "ok": False,
                **ErrorRecord.from_exception(e).to_json(),
                "traceback": traceback.format_exc(limit=4),
            }
            del e
            gc.collect()
        answer["elapsed_s"] = time.monotonic() - t0
        print(json.dumps(answer), flush=True)
    _close()


if __name__ == "__main__":
    main()
