"""Print the bench record as a table, and write it as JSON or a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from wtcore.stats import PHASES
from wtcore.units import format_size
from wtcore_bench.api import OptionalDependencyError

__all__ = ["check_plot_available", "print_table", "write_json", "write_plot"]


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_table(record: dict[str, Any], out: TextIO) -> None:
    s = record["settings"]
    out.write(
        f"wtcore bench: backend {s['backend']}, client {s['client']}, "
        f"{s['receivers']} receiver(s), {format_size(s['model_bytes'])} in "
        f"{s['model_tensors']} {s['dtype']} tensors, {s['rounds']} round(s)\n\n"
    )
    phase_cols = "".join(f"{p[:6]:>8}" for p in PHASES)
    for run in record["runs"]:
        buf = "engine default" if run["buffer_size"] is None else format_size(run["buffer_size"])
        kind = f", {run['round_kind']} rounds" if "round_kind" in run else ""
        out.write(f"buffer: {buf}{kind}\n")
        out.write(f"{'round':>5} {'seconds':>8} {'GB/s':>7}{phase_cols}")
        out.write(f" {'trainer+MiB':>11} {'recv+MiB':>9} {'paused':>7}  verified\n")
        for i, r in enumerate(run["rounds"]):
            phases = "".join(f"{r['phases'][p]:8.3f}" for p in PHASES)
            recv = max((m for m in r["receivers_extra_mib"] if m is not None), default=None)
            ratios = [x for x in r.get("paused_ratio", []) if x is not None]
            paused = f"{max(ratios):7.1%}" if ratios else f"{'-':>7}"
            verdict = "yes" if r["verified"] else f"NO: {r['mismatched_tensors']}"
            out.write(f"{i:>5} {r['seconds']:8.3f} {r['gbps']:7.2f}{phases}")
            out.write(f" {_mib(r['trainer_extra_mib']):>11} {_mib(recv):>9} {paused}  {verdict}\n")
        out.write(f"{'median':>5} {run['median_seconds']:8.3f} {run['median_gbps']:7.2f}\n\n")
    measured = record["baselines_gbps"]
    given = record.get("baseline_labels", {})
    peers = set(record.get("peers", []))
    in_turns = set(record.get("interleaved", []))
    labels = {n: given.get(n, n) + (" *" if n in in_turns else "") for n in measured}
    width = max([36, *(len(labels[n]) for n in measured)])
    for title, names in (
        ("measured in this run", [n for n in measured if n not in peers]),
        ("peers: what you would use instead", [n for n in measured if n in peers]),
    ):
        if not names:
            continue
        out.write(f"{title:<{width + 2}} GB/s   wtcore (best median) vs it\n")
        for name in names:
            ratio = record["ratios"].get(name)
            rel = "-" if ratio is None else f"{ratio:.2f}x"
            out.write(f"  {labels[name]:<{width}} {measured[name]:6.2f}   {rel}\n")
    if in_turns:
        out.write("  * measured in turns with the engine's rounds, one call before each\n")
    for name, why in record.get("skipped_baselines", {}).items():
        out.write(f"  skipped {name}: {why}\n")
    link = record.get("link")
    if link is not None and link.get("achieved_fraction") is not None:
        out.write(
            f"\nlink cap {link['rate']} per node ({link['cap_gbps']:.3f} GB/s each way), "
            f"{link['receivers']} receiver(s) on {link['nodes']} node(s): achieved "
            f"{record['best_median_gbps']:.3f} GB/s = {link['achieved_fraction']:.2f}x the cap\n"
        )
    out.write(
        "\nOK: every receiver verified bit-exact\n"
        if record["ok"]
        else "\nFAILED: a receiver does not match the trainer\n"
    )


def write_json(record: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def check_plot_available() -> None:
    """Fail before the run, not after it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise OptionalDependencyError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'wtcore-bench[plot]')"
        ) from e


def write_plot(record: dict[str, Any], path: str | Path) -> None:
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    xs = [r["buffer_size"] or 0 for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [x / 2**20 for x in xs],
        [r["median_gbps"] for r in runs],
        "o-",
        label=record["settings"]["backend"],
    )
    for name, gbps in record["baselines_gbps"].items():
        label = record.get("baseline_labels", {}).get(name, name)
        ax.axhline(gbps, linestyle="--", linewidth=1, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size (MiB)")
    ax.set_ylabel("GB/s (median)")
    settings = record["settings"]
    ax.set_title(
        f"wtcore bench: {format_size(settings['model_bytes'])}, {settings['receivers']} receiver(s)"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
