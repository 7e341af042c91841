#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draws a `moert run --trace` file without a browser: one lane per rank and stream, a bar per span, coloured by
stage (forward stages and backward parts), over the steps or micro-batches chosen.

    python3 trace_plot.py TRACE.json OUT.png [--step N] [--ranks R]

--step N draws step N only (default: the last step in the trace); --ranks R the first R ranks (default: all).
Exit status: 0 written; 2 bad arguments or trace; 3 matplotlib is missing (the message says how to install it).
"""
import argparse
import json
import sys

MISSING_MATPLOTLIB = 3
FORWARD = ["router", "permute", "dispatch", "fc1", "act", "fc2", "combine"]


def spans_of(trace, step, ranks):
    """(lanes, spans): lanes as (rank, stream name) in order, spans as (lane index, start ms, dur ms, stage)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    # the stage spans; kernels (`--trace-kernels`) are for Perfetto and tools/trace_summary.py --kernels
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "kernel"]
    if not spans:
        raise ValueError("the trace holds no spans")
    steps = sorted({e["args"]["step"] for e in spans})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError("step %d is not in the trace (it has %s)" % (step, steps))
    chosen = [e for e in spans if e["args"]["step"] == step and (ranks is None or e["pid"] < ranks)]
    lanes = sorted({(e["pid"], names.get((e["pid"], e["tid"]), str(e["tid"]))) for e in chosen},
                   key=lambda k: (k[0], k[1] != "compute", k[1]))
    index = {lane: i for i, lane in enumerate(lanes)}
    t0 = min(e["ts"] for e in chosen)
    out = []
    for e in chosen:
        lane = (e["pid"], names.get((e["pid"], e["tid"]), str(e["tid"])))
        out.append((index[lane], (e["ts"] - t0) / 1e3, e["dur"] / 1e3, e["name"].split(" ", 1)[1]))
    return step, lanes, out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        with open(a.trace, encoding="utf-8") as f:
            step, lanes, spans = spans_of(json.load(f), a.step, a.ranks)
    except (OSError, ValueError, KeyError) as e:
        print("trace_plot: %s: %s" % (a.trace, e), file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("trace_plot: needs the Python module matplotlib (Debian/Ubuntu: apt-get install python3-matplotlib)",
              file=sys.stderr)
        return MISSING_MATPLOTLIB
    stages = FORWARD + sorted({s[3] for s in spans} - set(FORWARD))
    cmap = plt.get_cmap("tab20")
    colour = {name: cmap(i % 20) for i, name in enumerate(stages)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.6), dpi=100)
    for lane, start, dur, stage in spans:
        ax.broken_barh([(start, max(dur, 1e-3))], (lane - 0.4, 0.8), facecolors=colour[stage], edgecolor="none")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(["rank %d %s" % lane for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first span")
    ax.set_title("moert trace: step %d" % step)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in stages]
    ax.legend(handles, stages, ncol=min(8, len(stages)), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(lanes) < 4 else -0.12), frameon=False)
    fig.tight_layout()
    fig.savefig(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
