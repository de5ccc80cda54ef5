"""``wtcore check URL... --sync CMD``: does a sync really write every weight?

Take each receiver's checksums, zero its weights, run the sync, compare: a weight the sync did
not write is still zero and is named. Exit 0 when all match, 1 on a mismatch, 2 when the check
could not run.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from typing import Any

__all__ = ["add_check_arguments", "run_check"]

#: vLLM's digest of a tensor without bytes: a weight its kernel keeps elsewhere (a vLLM CPU
#: server without wtcore's adapter), which neither its checksum nor its reset reaches.
_NO_BYTES = hashlib.sha256(b"").hexdigest()


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
        print(_line(url, baseline, result))
        failed = failed or not result.get("match")
    return 1 if failed else 0


def _line(url: str, baseline: dict[str, str], result: dict[str, Any]) -> str:
    total, blind = len(baseline), [n for n, d in baseline.items() if d == _NO_BYTES]
    unseen = f"; {len(blind)} hold no bytes there, unchecked: {_names(blind)}" if blind else ""
    if result.get("match"):
        return f"{url}: match ({total} tensors{unseen})"
    bad = [str(n) for n in result.get("mismatches", [])]
    return f"{url}: MISMATCH in {len(bad)} of {total} tensors ({_names(bad)}{unseen})"


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
