#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draws `moert ab --plot`'s figure: step time and loss of both sides over the steps, and beside them the distributions:
each side's measured step times, and the ratio B/A of their medians with its interval (and A'/A's with --aa).

    python3 ab_plot.py DATA.json OUT.png

`moert ab --plot OUT.png` writes DATA.json (OUT.plot.json) and runs this script; run it again by hand to redraw or
restyle the figure from the same data. DATA.json holds:

    {"title": "...", "differs": ["memory_policy: A {...}, B {...}", ...], "warmup": 2,
     "sides": [{"label": "A \"keep\"", "step_ms": [...], "loss": [...]}, {...B...}, optionally {...A'...}],
     "step_ratio": {"what": "B/A", "ratio": 1.04, "ci_low": 1.01, "ci_high": 1.07, "level": 0.95, "pairs": 20,
                    "verdict": "B slower by ..."},
     "step_noise": {...the same for A'/A, with --aa...}}

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
    if not isinstance(sides, list) or len(sides) not in (2, 3):
        raise ValueError("expected \"sides\": a list of two objects (A, B) or three (A, B, A')")
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


def ratio_label(data):
    """What the ratio panel compares, from the first "differs" line: 'B/A (B changes precision: ...)'."""
    differs = data.get("differs") or []
    what = differs[0].split(":")[0] if differs else "nothing (the same config twice)"
    return "B changes " + what


def draw_distributions(ax, data, colors, warmup):
    """Each side's measured step times as a histogram along the step-time axis (shared with the panel on the left),
    with its median as a line."""
    kept = [[v for v in s["step_ms"][warmup:] if v is not None] for s in data["sides"]]
    values = [v for k in kept for v in k]
    if not values:
        return
    low, high = min(values), max(values)
    bins = [low + (high - low) * i / 20.0 for i in range(21)] if high > low else 5
    for i, k in enumerate(kept):
        if not k:
            continue
        ax.hist(k, bins=bins, orientation="horizontal", color=colors[i], alpha=0.45 if i < 2 else 0.3,
                histtype="stepfilled", zorder=2 + i)
        median = sorted(k)[len(k) // 2] if len(k) % 2 else 0.5 * sum(sorted(k)[len(k) // 2 - 1:len(k) // 2 + 1])
        ax.axhline(median, color=colors[i], lw=1.5, ls="-" if i < 2 else ":", zorder=5)
    ax.set_xlabel("measured steps", fontsize=8)
    ax.set_title("step time: distribution", fontsize=9)
    ax.tick_params(labelleft=False, labelsize=8)
    ax.grid(True, color="0.85", lw=0.6)


def draw_ratio(ax, data, colors):
    """B/A of the median step time with its interval, A'/A's below it (the noise floor), and 1 (no difference)."""
    rows = [(r, c) for r, c in ((data.get("step_ratio"), colors[1]), (data.get("step_noise"), "0.45")) if r]
    ax.axvline(1.0, color="0.3", lw=0.8, ls="--", zorder=1)
    labels = []
    for y, (r, color) in enumerate(rows):
        labels.append(r.get("what", "B/A"))
        if r.get("ratio") is None:
            continue
        lo, hi = r.get("ci_low"), r.get("ci_high")
        if lo is not None and hi is not None:
            ax.errorbar([r["ratio"]], [y], xerr=[[r["ratio"] - lo], [hi - r["ratio"]]], fmt="o", color=color,
                        ecolor=color, capsize=4, lw=2, zorder=3)
        else:
            ax.plot([r["ratio"]], [y], "o", color=color, zorder=3)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(-0.7, max(len(labels), 1) - 0.3)
    ax.invert_yaxis()
    level = (rows[0][0].get("level") if rows else None) or 0.95
    ax.set_xlabel("median step time ratio (%d%% CI)" % round(level * 100), fontsize=8)
    ax.set_title("\n".join(textwrap.wrap(ratio_label(data), 34)[:2]), fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, axis="x", color="0.85", lw=0.6)


def draw(data, out):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    warmup = int(data.get("warmup", 0))
    colors = ("#1f77b4", "#ff7f0e", "0.45")  # A blue (thick, below), B orange (thin, on top: both stay visible), A' grey
    widths = (3.0, 1.5, 1.0)
    fig = plt.figure(figsize=(9, 6.4), dpi=100)
    grid = fig.add_gridspec(2, 2, width_ratios=(3.2, 1.3))
    ax_ms = fig.add_subplot(grid[0, 0])
    ax_loss = fig.add_subplot(grid[1, 0], sharex=ax_ms)
    ax_dist = fig.add_subplot(grid[0, 1], sharey=ax_ms)
    ax_ratio = fig.add_subplot(grid[1, 1])
    all_ms = []  # per side
    for i, side in enumerate(data["sides"]):
        steps = list(range(1, len(side["step_ms"]) + 1))
        z = (2, 3, 1.5)[i]  # A' below A: where the two agree, A's line shows
        ax_ms.plot(steps, side["step_ms"], color=colors[i], lw=widths[i], label=side.get("label", ("A", "B", "A'")[i]),
                   zorder=z)
        ax_loss.plot(steps, side["loss"], color=colors[i], lw=widths[i], zorder=z)
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
    ax_ms.legend(loc="upper right", fontsize=7, title=legend_text(data), title_fontsize=7, framealpha=0.9)
    draw_distributions(ax_dist, data, colors, warmup)
    ax_dist.set_ylim(low, high)
    draw_ratio(ax_ratio, data, colors)
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
