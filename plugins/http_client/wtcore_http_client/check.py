"""``wtcore check URL... --sync CMD``: does a sync really write every weight?

The round trip users of several RL frameworks ask for, after rounds that answered 200 and
loaded garbage: take each receiver's checksums, zero its weights (``weight_checker`` reset),
run the sync (your own command: a trainer step, a script), and compare. A weight the sync did
not write is still zero, so it differs from its baseline and is named. Works against wtcore's
receivers and vLLM servers alike (``POST /weight_checker``, ``VLLM_SERVER_DEV_MODE=1``).

It prints one line per receiver and exits 0 when every one matches, 1 on any mismatch, 2 when
the check itself could not run (a receiver unreachable, the sync command failed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

__all__ = ["add_check_arguments", "run_check"]


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("urls", nargs="+", metavar="URL", help="receivers (wtcore or vLLM servers)")
    p.add_argument(
        "--sync",
        required=True,
        metavar="CMD",
        help="the command that syncs the weights (a shell line)",
    )
    p.add_argument("--api-key", default=None, help="bearer token for the receivers")
    p.add_argument("--timeout-s", type=float, default=600.0, help="for the sync (default 600)")
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    from wtcore.errors import WtcoreError
    from wtcore_http_client.client import HTTPWeightSyncClient

    try:
        with HTTPWeightSyncClient(args.urls, api_key=args.api_key, timeout_s=120) as client:
            baselines = [a["checksums"] for a in client.weight_checker("checksum")]
            client.weight_checker("reset")
            done = subprocess.run(args.sync, shell=True, timeout=args.timeout_s, check=False)
            if done.returncode != 0:
                print(f"wtcore check: the sync command exited {done.returncode}", file=sys.stderr)
                return 2
            results = client.weight_checker("compare", baselines)
    except (WtcoreError, subprocess.TimeoutExpired) as e:
        print(f"wtcore check: {e}", file=sys.stderr)
        return 2
    failed = False
    for url, baseline, result in zip(args.urls, baselines, results, strict=True):
        print(_line(url, len(baseline), result))
        failed = failed or not result.get("match")
    return 1 if failed else 0


def _line(url: str, total: int, result: dict[str, Any]) -> str:
    if result.get("match"):
        return f"{url}: match ({total} tensors)"
    bad = [str(n) for n in result.get("mismatches", [])]
    shown = ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else "")
    return f"{url}: MISMATCH in {len(bad)} of {total} tensors ({shown})"
