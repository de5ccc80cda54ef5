"""Draw an RL loop log (``run.py --json``), per run: reward, mismatch, step and sync time per
step, and sync against paused time per step (the runs that sync)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: The mismatch panel is logarithmic; an exact 0 (both sides agree to the bit) is drawn here.
FLOOR = 1e-9
#: The CI test's tolerance (tests/vllm/test_rl_loop.py), drawn for reference.
TOLERANCE = 1e-3


def plot(log: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"drawing {out} needs matplotlib: pip install matplotlib ({e})") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_m, ax_s, ax_p) = plt.subplots(1, 4, figsize=(17, 3.6))
    bars = ""
    for i, (name, run) in enumerate(log["runs"].items()):
        steps, color = run["steps"], f"C{i}"
        x = [s["step"] for s in steps]
        label = f"{name} (sync {'on' if run['sync'] else 'off'})"
        if "steps_per_min" in run:
            label += f", {run['steps_per_min']:.0f} steps/min"
        ax_r.plot(x, [s["reward"] for s in steps], color=color, marker="o", ms=3, label=label)
        for field, style in (("mean", "-"), ("max", "--")):
            y = [max(s[f"mismatch_{field}"], FLOOR) for s in steps]
            ax_m.plot(x, y, color=color, ls=style, marker="o", ms=2, label=f"{name}, {field}")
        if run["sync"] and not bars:  # the first synced run's
            bars = name
            ax_s.bar(x, [s["step_s"] for s in steps], color="0.85", label="whole step")
            what = log["config"].get("sync_label", "pause + sync + resume")
            ax_s.bar(x, [s["sync_s"] for s in steps], color="C1", label=what)
        if run["sync"] and "paused_s" in steps[0]:
            ax_p.plot(
                x,
                [s["sync_s"] for s in steps],
                color=color,
                marker="o",
                ms=3,
                label=f"{name}, sync",
            )
            paused = [s["paused_s"] for s in steps]
            ax_p.plot(x, paused, color=color, ls="--", marker="x", ms=4, label=f"{name}, paused")
    ax_r.set(title="mean reward", xlabel="step")
    ax_m.axhline(TOLERANCE, color="0.5", lw=1, ls=":", label="CI tolerance")
    ax_m.set(
        title="|logprob vLLM - logprob trainer|",
        xlabel=f"step (0 drawn at {FLOOR:g})",
        yscale="log",
        ylim=(FLOOR / 2, None),
    )
    ax_s.set(title=f"sync time ({bars} run)", xlabel="step", ylabel="s")
    ax_p.set(title="sync and vLLM's paused time", xlabel="step", ylabel="s", ylim=(0, None))
    for ax in (ax_r, ax_m, ax_s, ax_p):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    cfg = log["config"]
    fig.suptitle(
        f"{cfg.get('title', 'wtcore RL loop')}: tiny Llama on vLLM (CPU), "
        f"backend {cfg['backend']}, "
        f"{cfg['group_size']} samples per prompt, lr {cfg['lr']:g}, seed {cfg['seed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_outputs(log: dict[str, Any], json_path: Path | None, png_path: Path | None) -> None:
    """A run's JSON log and its picture, each where asked (``--json``, ``--plot``)."""
    if json_path is not None:
        json_path.write_text(json.dumps(log, indent=1) + "\n")
        print(f"wrote {json_path}")
    if png_path is not None:
        plot(log, png_path)
        print(f"wrote {png_path}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: plot.py LOG.json OUT.png")
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
