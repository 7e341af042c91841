#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draws `moert ab --plot`'s figure: step time and loss of both sides over the steps.

    python3 ab_plot.py DATA.json OUT.png

`moert ab --plot OUT.png` writes DATA.json (OUT.plot.json) and runs this script; run it again by hand to redraw or
restyle the figure from the same data. DATA.json holds:

    {"title": "...", "differs": ["memory_policy: A {...}, B {...}", ...], "warmup": 2,
     "sides": [{"label": "A \"keep\"", "step_ms": [...], "loss": [...]}, {...B...}]}

Exit status: 0 written; 2 bad arguments or data; 3 matplotlib is missing (the message says how to install it).
"""
import json
import os
import sys
import textwrap

MISSING_MATPLOTLIB = 3


def load(path):
    """Reads and checks DATA.json; raises ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    sides = data.get("sides")
    if not isinstance(sides, list) or len(sides) != 2:
        raise ValueError("expected \"sides\": a list of two objects (A, B)")
    for s in sides:
        if len(s.get("step_ms", [])) != len(s.get("loss", [])):
            raise ValueError("side %s: step_ms and loss differ in length" % s.get("label", "?"))
    return data


def measured_range(series, warmup):
    """The step-time axis covers both sides' measured steps, so a slow first step does not flatten the rest (warm-up
    points above it run off the panel)."""
    kept = [v for s in series for v in s[warmup:] if v is not None]
    kept = kept or [v for s in series for v in s if v is not None] or [0.0]
    low, high = min(kept), max(kept)
    pad = (high - low) * 0.08 or max(abs(high) * 0.05, 1e-3)
    return low - pad, high + pad


def legend_text(data):
    """What B changes, for the legend's title: the "differs" lines of moert ab's header, wrapped."""
    differs = data.get("differs") or ["nothing in the config (the same config twice: run-to-run spread)"]
    lines = []
    for d in differs:
        lines += textwrap.wrap("B changes " + d, 70) or [""]
    return "\n".join(lines[:6] + (["..."] if len(lines) > 6 else []))


def draw(data, out):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    warmup = int(data.get("warmup", 0))
    colors = ("#1f77b4", "#ff7f0e")  # A blue (thick, below), B orange (thin, on top: both stay visible)
    widths = (3.0, 1.5)
    fig, (ax_ms, ax_loss) = plt.subplots(2, 1, figsize=(9, 6.4), dpi=100, sharex=True)
    all_ms = []  # per side
    for i, side in enumerate(data["sides"]):
        steps = list(range(1, len(side["step_ms"]) + 1))
        ax_ms.plot(steps, side["step_ms"], color=colors[i], lw=widths[i], label=side.get("label", "AB"[i]), zorder=2 + i)
        ax_loss.plot(steps, side["loss"], color=colors[i], lw=widths[i], zorder=2 + i)
        all_ms.append(side["step_ms"])
    low, high = measured_range(all_ms, warmup)
    ax_ms.set_ylim(low, high)
    for ax in (ax_ms, ax_loss):
        if warmup > 0:
            ax.axvspan(0.5, warmup + 0.5, color="0.92", zorder=0, label="warm-up" if ax is ax_ms else None)
        ax.grid(True, color="0.85", lw=0.6)
    ax_ms.set_ylabel("step time (ms)")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("step")
    ax_ms.legend(loc="upper right", fontsize=8, title=legend_text(data), title_fontsize=8, framealpha=0.9)
    fig.suptitle(data.get("title", "moert ab"), fontsize=10)
    fig.tight_layout()
    # written beside and renamed into place, so a failed draw leaves the previous figure whole
    tmp = "%s.%d.tmp.png" % (out, os.getpid())
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv):
    if len(argv) != 3:
        print("usage: ab_plot.py DATA.json OUT.png", file=sys.stderr)
        return 2
    try:
        data = load(argv[1])
    except (OSError, ValueError) as e:
        print("ab_plot.py: %s: %s" % (argv[1], e), file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401  (checked before drawing, to say what is missing)
    except ImportError:
        print("ab_plot.py: the Python module matplotlib is missing for %s (Debian/Ubuntu: apt-get install "
              "python3-matplotlib; or pip install matplotlib)" % sys.executable, file=sys.stderr)
        return MISSING_MATPLOTLIB
    draw(data, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
