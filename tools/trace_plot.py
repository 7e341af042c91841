#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draws a `moert run --trace` file without a browser: one lane per rank and stream, a bar per span, coloured by
stage (forward stages and backward parts), over the steps or micro-batches chosen.

    python3 trace_plot.py TRACE.json OUT.png [--step N] [--ranks R] [--kernels] [--window FROM TO]

--step N draws step N only (default: the last step in the trace); --ranks R the first R ranks (default: all);
--kernels adds a lane per CUDA stream with the kernels of a `moert run --trace-kernels` trace, coloured by kind (the
wgmma GEMMs, cuBLASLt's, the dispatcher's, the rest); --window FROM TO draws FROM to TO ms after the step's first span.
Exit status: 0 written; 2 bad arguments or trace; 3 matplotlib is missing (the message says how to install it).
"""
import argparse
import json
import sys

from trace_summary import thread_names  # tools/, beside this script

MISSING_MATPLOTLIB = 3
FORWARD = ["router", "permute", "dispatch", "fc1", "act", "fc2", "combine"]


KERNEL_KINDS = ["kernel: wgmma GEMM", "kernel: cuBLASLt GEMM", "kernel: dispatcher", "kernel: other"]


def kernel_kind(name):
    """The colour group of a kernel by its name."""
    n = name.lower()
    if "wgmma" in n or "block_gemm" in n:
        return KERNEL_KINDS[0]
    if n.startswith(("nvjet", "sm90_xmma", "cutlass")) or "gemm" in n:
        return KERNEL_KINDS[1]
    if "dispatch" in n or "combine" in n or "nccl" in n:
        return KERNEL_KINDS[2]
    return KERNEL_KINDS[3]


def kernels_of(trace, t0, t1, ranks):
    """(lanes, spans) of the kernels that start within [t0, t1) us: lanes (rank, row name), spans (lane, start us, dur
    us, kind)."""
    names = thread_names(trace)
    chosen = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"
              and t0 <= e["ts"] < t1 and (ranks is None or e["pid"] < ranks)]
    lanes = sorted({(e["pid"], names.get((e["pid"], e["tid"]), str(e["tid"]))) for e in chosen},
                   key=lambda k: (k[0], int(k[1].rsplit(" ", 1)[-1]) if k[1].rsplit(" ", 1)[-1].isdigit() else 0, k[1]))
    index = {lane: i for i, lane in enumerate(lanes)}
    return lanes, [(index[(e["pid"], names.get((e["pid"], e["tid"]), str(e["tid"])))], e["ts"], e["dur"],
                    kernel_kind(e["name"])) for e in chosen]


def spans_of(trace, step, ranks, kernels=False):
    """(step, lanes, spans): lanes as (rank, stream name) in order, spans as (lane index, start ms, dur ms, stage or
    kernel kind); with `kernels` the kernels' lanes after the stages'."""
    names = thread_names(trace)
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
    t1 = max(e["ts"] + e["dur"] for e in chosen)
    out = []
    for e in chosen:
        lane = (e["pid"], names.get((e["pid"], e["tid"]), str(e["tid"])))
        out.append((index[lane], (e["ts"] - t0) / 1e3, e["dur"] / 1e3, e["name"].split(" ", 1)[1]))
    if kernels:
        klanes, kspans = kernels_of(trace, t0, t1, ranks)
        if not klanes:
            raise ValueError("no kernels in step %d (`moert run --trace FILE --trace-kernels` records them)" % step)
        base = len(lanes)
        lanes = lanes + klanes
        out += [(base + lane, (ts - t0) / 1e3, dur / 1e3, kind) for lane, ts, dur, kind in kspans]
    return step, lanes, out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--window", type=float, nargs=2, metavar=("FROM", "TO"), default=None)
    a = ap.parse_args(argv)
    if a.window and a.window[1] <= a.window[0]:
        print("trace_plot: --window FROM TO needs FROM < TO", file=sys.stderr)
        return 2
    try:
        with open(a.trace, encoding="utf-8") as f:
            step, lanes, spans = spans_of(json.load(f), a.step, a.ranks, a.kernels)
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
    if a.window:
        spans = [(lane, max(start, a.window[0]), min(start + dur, a.window[1]) - max(start, a.window[0]), stage)
                 for lane, start, dur, stage in spans if start < a.window[1] and start + dur > a.window[0]]
        used = sorted({s[0] for s in spans})
        renumber = {lane: i for i, lane in enumerate(used)}
        lanes = [lanes[i] for i in used]
        spans = [(renumber[lane], start, dur, stage) for lane, start, dur, stage in spans]
        if not spans:
            print("trace_plot: nothing runs in --window %g %g" % tuple(a.window), file=sys.stderr)
            return 2
    present = {s[3] for s in spans}
    stages = [n for n in FORWARD if n in present] + sorted(present - set(FORWARD) - set(KERNEL_KINDS)) + \
        [k for k in KERNEL_KINDS if k in present]
    cmap = plt.get_cmap("tab20")
    colour = {name: cmap(i % 20) for i, name in enumerate(stages)}
    colour.update(zip(KERNEL_KINDS, ["#d62728", "#1f77b4", "#2ca02c", "#7f7f7f"]))
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.6), dpi=100)
    for lane, start, dur, stage in spans:
        ax.broken_barh([(start, max(dur, 1e-3))], (lane - 0.4, 0.8), facecolors=colour[stage], edgecolor="none")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(["rank %d %s" % (r, n.replace("kernels, CUDA stream", "kernels, stream")) for r, n in lanes])
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
