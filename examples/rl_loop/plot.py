"""Draw an RL loop log (``run.py --json``): reward, mismatch and sync time per step, per run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(log: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"drawing {out} needs matplotlib: pip install matplotlib ({e})") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_m, ax_s) = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, run in log["runs"].items():
        steps = run["steps"]
        x = [s["step"] for s in steps]
        label = f"{name} (sync {'on' if run['sync'] else 'off'})"
        ax_r.plot(x, [s["reward"] for s in steps], marker="o", ms=3, label=label)
        ax_m.plot(x, [s["mismatch_mean"] for s in steps], marker="o", ms=3, label=f"{name}, mean")
        ax_m.plot(x, [s["mismatch_max"] for s in steps], ls="--", lw=1, label=f"{name}, max")
        if run["sync"]:
            ax_s.bar(x, [s["step_s"] for s in steps], color="0.85", label="whole step")
            ax_s.bar(x, [s["sync_s"] for s in steps], color="C1", label="pause + sync + resume")
    ax_r.set(title="mean reward", xlabel="step")
    ax_m.set(title="|logprob vLLM - logprob trainer|", xlabel="step", yscale="log")
    ax_s.set(title="sync time (synced run)", xlabel="step", ylabel="s")
    for ax in (ax_r, ax_m, ax_s):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    cfg = log["config"]
    fig.suptitle(
        f"wtcore RL loop: tiny Llama on vLLM (CPU), backend {cfg['backend']}, "
        f"{cfg['group_size']} samples per prompt, lr {cfg['lr']:g}, seed {cfg['seed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: plot.py LOG.json OUT.png")
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
