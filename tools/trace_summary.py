#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sums up a `moert run --trace` file per rank and step, as text (or JSON): what overlaps, and where time goes.

    python3 trace_summary.py TRACE.json [--ranks R] [--json] [--host] [--kernels [--against OTHER.json]
                             [--top N] [--gaps [--min-gap US]]]

Per rank and step:
  span      first span's start to last span's end (every stream): the layers' share of the step
  idle      time within the span when no compute or wgrad stream runs a span (a wait such as wgrad_wait counts as
            idle: the stream only waits there)
  communication alone
            time a dispatcher call runs while no stream runs a computing span (any stage or backward part but the
            dispatcher's own stages permute, dispatch, combine, combine_bwd, dispatch_bwd, whose spans hold the
            wait for the call): the all-to-alls nothing hides
  streams   each stream's busy time (the union of its spans)
  merged    with the micro-batch overlap (a "compute.1" stream) and M >= 2 micro-batches of L layers: the steady
            state, from micro-batch 1's first forward (layer 0's router) to the start of the last micro-batch's
            backward (layer L-1's combine_bwd), which holds micro-batches 1..M-1's forwards merged with 0..M-2's
            backwards: per layer and micro-batch, that window / ((M-1) L). The first forward and the last backward run
            alone before and after it
  dispatcher calls, summed over the step's layers and micro-batches: each call's own time (the "dispatcher" stream)
            against its stage's span on the compute stream; the difference ("waited") is what the stage spent before
            and after the call itself: under the micro-batch overlap, the other slot's dispatcher calls queued before
            it on the communication stream, and the fences
  host      from the "host" spans (moert's own, API version 10): the time the host spent in the layers' calls (the
            union of the spans of every slot's host rows), and in each dispatcher call, summed over layers and
            micro-batches: where a call holds the host up (on GPUs a dispatcher that waits for its peers' counts);
            with --host also per stage and backward part, summed over layers and micro-batches, the --top N longest
            (on GPUs the time the host took to issue each, its waits included: e.g. a cuBLASLt loop's calls), and
            after the steps, per rank over every step but the first, each one's mean per call (one layer and
            micro-batch)
With --kernels (a trace of `moert run --trace FILE --trace-kernels`), per rank over every step but the first, per step
and within each step's window (the merged halves with the overlap, else the step's span):
  kernels   how long the GPU ran no kernel, one, two, three or more at once; per kernel name (the function's own
            name) its calls, time, the part of it no other kernel ran beside it ("alone") and its mean call, and with
            --against OTHER.json that mean in the other trace and the ratio (e.g. the overlap on against off: how
            much the halves slow each kernel); the pairs of kernels that ran together longest
  gaps      with --gaps: where the GPU ran no kernel, in gaps of --min-gap us (20) or more between one kernel's end
            and the next one's start, grouped by the stages the compute streams ran at the gap's middle, what the
            host was doing there (its innermost "host" span, e.g. dispatcher.prepare) and the kernels before and
            after it (where the host held the GPU up, e.g. a host synchronization)
The step's loss, optimizer and next inputs are not layer spans: the gap between two steps' spans holds them.
The text ends with the range and the median of the merged halves per layer and micro-batch over every rank and step
but the first (whose first forward includes the warm-up), the steady state the micro-batch overlap's targets are set
for:
  steady state: 4.41-4.52 ms per layer and micro-batch, median 4.44 (merged halves, ranks 0-1, steps 2-4)
Exit status: 0; 2 bad arguments or trace.
"""
import argparse
import collections
import json
import statistics
import sys

# each dispatcher call and the stage (forward) or backward part it runs in
CALL_STAGE = {"prepare": "permute", "dispatch": "dispatch", "combine": "combine",
              "combine_backward": "combine_bwd", "dispatch_backward": "dispatch_bwd"}
COMM_STAGES = set(CALL_STAGE.values())


def union_ms(intervals):
    """The length in ms of the union of (start_us, end_us) intervals."""
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        total += cur[1] - cur[0]
    return total / 1e3


def uncovered_ms(intervals, cover):
    """The length in ms of the union of `intervals` outside the union of `cover` ((start_us, end_us) each)."""
    def merged(iv):
        out = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out
    cover, total = merged(cover), 0.0
    for a, b in merged(intervals):
        cur = a
        for c, d in cover:
            if d <= cur or c >= b:
                continue
            total += max(0.0, c - cur)
            cur = max(cur, d)
            if cur >= b:
                break
        total += max(0.0, b - cur)
    return total / 1e3


def thread_names(trace):
    """{(pid, tid): row name} of a trace's rows (streams, the host, CUDA streams' kernels)."""
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def summarize(trace, ranks=None):
    """A list of per rank and step summaries (dicts), in rank and step order."""
    names = thread_names(trace)
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "kernel"
             and (ranks is None or e["pid"] < ranks)]
    if not spans:
        raise ValueError("the trace holds no spans")
    groups = collections.defaultdict(list)
    host = collections.defaultdict(list)  # the host's spans: what the host did, not a stream's work
    for e in spans:
        on_host = names.get((e["pid"], e["tid"]), "").startswith("host")
        (host if on_host else groups)[(e["pid"], e["args"]["step"])].append(e)
    out = []
    for (rank, step), es in sorted(groups.items()):
        t0 = min(e["ts"] for e in es)
        t1 = max(e["ts"] + e["dur"] for e in es)
        by_stream = collections.defaultdict(list)
        work, compute, call_spans = [], [], []
        for e in es:
            stream = names.get((e["pid"], e["tid"]), str(e["tid"]))
            iv = (e["ts"], e["ts"] + e["dur"])
            by_stream[stream].append(iv)
            stage = e["name"].split(" ", 1)[1]
            if stream == "dispatcher":
                call_spans.append(iv)
            elif not stage.endswith("_wait"):
                work.append(iv)
                if stage not in COMM_STAGES:
                    compute.append(iv)
        calls = collections.OrderedDict((c, {"call_ms": 0.0, "stage_ms": 0.0, "count": 0}) for c in CALL_STAGE)
        stage_of = {}
        for e in es:
            stage_of[(e["args"]["layer"], e["args"]["micro_batch"], e["name"].split(" ", 1)[1])] = e
        for (layer, micro, name), e in stage_of.items():
            if not name.startswith("dispatcher."):
                continue
            call = name.split(".", 1)[1]
            stage = stage_of.get((layer, micro, CALL_STAGE.get(call, "")))
            if call not in calls or stage is None:
                continue
            calls[call]["call_ms"] += e["dur"] / 1e3
            calls[call]["stage_ms"] += stage["dur"] / 1e3
            calls[call]["count"] += 1
        merged = None
        micro_batches = 1 + max(e["args"]["micro_batch"] for e in es)
        layers = 1 + max(e["args"]["layer"] for e in es)
        if "compute.1" in by_stream and micro_batches >= 2:
            first = stage_of.get((0, 1, "router"))
            last = stage_of.get((layers - 1, micro_batches - 1, "combine_bwd"))
            if first and last and last["ts"] > first["ts"]:
                window = (last["ts"] - first["ts"]) / 1e3
                merged = {"window_ms": window, "per_layer_micro_batch_ms": window / ((micro_batches - 1) * layers),
                          "first_forward_alone_ms": (first["ts"] - t0) / 1e3,
                          "last_backward_alone_ms": (t1 - last["ts"]) / 1e3}
        window = (first["ts"], last["ts"]) if merged else (t0, t1)
        out.append({"rank": rank, "step": step, "span_ms": (t1 - t0) / 1e3, "merged": merged, "window_us": window,
                    "idle_ms": (t1 - t0) / 1e3 - union_ms(work),
                    "communication_alone_ms": uncovered_ms(call_spans, compute),
                    "streams_ms": {s: union_ms(ivs) for s, ivs in sorted(by_stream.items())},
                    "dispatcher_calls": {c: v for c, v in calls.items() if v["count"]},
                    "host": host_figures(host.get((rank, step), []))})
    return out


def host_figures(es):
    """The host's figures of one rank and step from its "host" spans: the union of their time in ms, per dispatcher
    call the sum of its spans, and per stage or backward part (dispatcher calls included) the sum of its spans and
    their count; None where the trace has no host spans (before API version 10)."""
    if not es:
        return None
    stages = collections.defaultdict(lambda: {"ms": 0.0, "count": 0})
    for e in es:
        stage = e["name"].split(" ", 1)[1]
        stages[stage]["ms"] += e["dur"] / 1e3
        stages[stage]["count"] += 1
    return {"in_layers_ms": union_ms([(e["ts"], e["ts"] + e["dur"]) for e in es]),
            "dispatcher_calls_ms": {c: stages["dispatcher." + c]["ms"] for c in CALL_STAGE
                                    if "dispatcher." + c in stages},
            "stages": dict(sorted(stages.items(), key=lambda kv: -kv[1]["ms"]))}


def kernels_and_windows(trace, rows):
    """The kernels of each rank, as (start us, end us, name), and each rank's windows (start us, end us) of every
    step but the first (every step where there is one), in rank order: [(rank, kernels, windows)]."""
    kernels = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            kernels[e["pid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    first = min((r["step"] for r in rows), default=None)
    out = []
    for rank in sorted(kernels):
        windows = [r["window_us"] for r in rows if r["rank"] == rank and r["step"] != first] or \
                  [r["window_us"] for r in rows if r["rank"] == rank]
        if windows:
            out.append((rank, kernels[rank], windows))
    return out


def kernel_summary(trace, rows, top=12):
    """The kernels of a `--trace-kernels` trace, per rank over every step but the first, within each step's window
    (the merged halves where the micro-batch overlap ran, else the step's span), per step: how long the GPU ran no
    kernel, one, two or more at once; per kernel name its calls, time and the part of it no other kernel ran beside
    it; the pairs of kernel names that ran together longest. {rank: {...}}; {} where the trace has no kernels."""
    out = {}
    for rank, kernels, windows in kernels_and_windows(trace, rows):
        level = collections.Counter()
        per_name = collections.defaultdict(lambda: {"calls": 0, "ms": 0.0, "alone_ms": 0.0})
        together = collections.Counter()
        for lo, hi in windows:
            inside = [k for k in kernels if lo <= k[0] < hi]
            events = []
            for i, (a, b, name) in enumerate(inside):
                per_name[name]["calls"] += 1
                per_name[name]["ms"] += (b - a) / 1e3
                events += [(max(a, lo), 1, i), (min(b, hi), -1, i)]
            events.sort(key=lambda x: (x[0], x[1]))
            active, t = set(), lo
            for x, d, i in events:
                seg = (x - t) / 1e3
                if seg > 0:
                    level[min(len(active), 3)] += seg
                    names = sorted({inside[j][2] for j in active})
                    if len(active) == 1:
                        per_name[names[0]]["alone_ms"] += seg
                    for ai in range(len(names)):
                        for bi in range(ai + 1, len(names)):
                            together[(names[ai], names[bi])] += seg
                t = max(t, x)
                if d > 0:
                    active.add(i)
                else:
                    active.discard(i)
            level[min(len(active), 3)] += max(0.0, hi - t) / 1e3
        n = len(windows)
        names = sorted(per_name.items(), key=lambda kv: -kv[1]["ms"])
        out[rank] = {
            "steps": n, "window_ms": sum(hi - lo for lo, hi in windows) / 1e3 / n,
            "running_ms": {str(k): level[k] / n for k in range(4)},
            "kernels": [{"name": k, "calls": v["calls"] / n, "ms": v["ms"] / n, "alone_ms": v["alone_ms"] / n,
                         "mean_us": 1e3 * v["ms"] / v["calls"]} for k, v in names],
            "together": [{"names": list(k), "ms": v / n} for k, v in together.most_common(top)]}
    return out


def gap_summary(trace, rows, min_us=20.0, top=12):
    """Where the GPU ran no kernel, per rank over every step but the first, within each step's window: each gap of at
    least min_us between one kernel's end and the next kernel's start, grouped by the compute streams' stages running
    at its middle and the kernels before and after it, per step, longest total first. {rank: {...}}."""
    names = thread_names(trace)
    stages, host = collections.defaultdict(list), collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") == "kernel":
            continue
        row = names.get((e["pid"], e["tid"]), "")
        if row.startswith("compute") or row.startswith("host"):
            (stages if row.startswith("compute") else host)[e["pid"]].append(
                (e["ts"], e["ts"] + e["dur"], e["name"].split(" ", 1)[1]))
    out = {}
    for rank, kernels, windows in kernels_and_windows(trace, rows):
        groups = collections.defaultdict(lambda: [0, 0.0])
        total = 0.0
        for lo, hi in windows:
            inside = sorted(k for k in kernels if lo <= k[0] < hi)
            end, before = None, None
            for a, b, name in inside:
                if end is not None and a - end >= min_us:
                    mid = (a + end) / 2
                    running = sorted({n for s0, s1, n in stages[rank] if s0 <= mid <= s1})
                    # what the host was doing: the innermost of its spans there (a dispatcher call in its stage)
                    doing = min(((s1 - s0, n) for s0, s1, n in host[rank] if s0 <= mid <= s1), default=(0, "-"))[1]
                    key = (",".join(running) or "-", doing, before, name)
                    groups[key][0] += 1
                    groups[key][1] += (a - end) / 1e3
                    total += (a - end) / 1e3
                if end is None or b > end:
                    end, before = b, name
        n = len(windows)
        out[rank] = {"steps": n, "min_gap_us": min_us, "idle_ms": total / n,
                     "gaps": [{"stages": k[0], "host": k[1], "after": k[2], "before": k[3], "count": v[0] / n,
                               "ms": v[1] / n}
                              for k, v in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]]}
    return out


def print_gaps(gs):
    """The text of gap_summary's figures."""
    for rank, r in gs.items():
        print("gaps, rank %d, per step (%d steps): %.2f ms with no kernel in gaps of %g us or more, where:" %
              (rank, r["steps"], r["idle_ms"], r["min_gap_us"]))
        for g in r["gaps"]:
            print("  %7.3f ms x%-5.1f in %s: after %s, before %s%s" % (
                g["ms"], g["count"], g["stages"][:40], g["after"][:32], g["before"][:32],
                "; the host in %s" % g["host"] if g["host"] != "-" else ""))


def print_kernels(ks, top, against=None):
    """The text of kernel_summary's figures; with `against` (another trace's), each name's mean call there too."""
    other = {}
    if against:
        for r in against.values():
            for k in r["kernels"]:
                other.setdefault(k["name"], k["mean_us"])
    for rank, r in ks.items():
        lv = r["running_ms"]
        print("kernels, rank %d, per step (%d steps; window %.2f ms): no kernel %.2f ms, one %.2f, two %.2f, three "
              "or more %.2f" % (rank, r["steps"], r["window_ms"], lv["0"], lv["1"], lv["2"], lv["3"]))
        head = "  %-44s %7s %9s %9s %9s" % ("kernel", "calls", "ms", "alone ms", "mean us")
        print(head + ("  %9s %6s" % ("there us", "ratio") if against else ""))
        for k in r["kernels"][:top]:
            line = "  %-44s %7.1f %9.3f %9.3f %9.1f" % (k["name"][:44], k["calls"], k["ms"], k["alone_ms"], k["mean_us"])
            if against and k["name"] in other:
                line += "  %9.1f %6.3f" % (other[k["name"]], k["mean_us"] / other[k["name"]])
            print(line)
        for t in r["together"][:5]:
            print("  together %.3f ms: %s + %s" % (t["ms"], t["names"][0][:40], t["names"][1][:40]))


def steady_state(rows):
    """The merged halves per layer and micro-batch over every rank and every step but the first: (min, max, median,
    ranks, steps), or None without the overlap's merged halves."""
    first = min((r["step"] for r in rows), default=None)
    kept = [r for r in rows if r["merged"] and r["step"] != first]
    if not kept:
        return None
    per = [r["merged"]["per_layer_micro_batch_ms"] for r in kept]
    return (min(per), max(per), statistics.median(per), sorted({r["rank"] for r in kept}),
            sorted({r["step"] for r in kept}))


def host_means(rows):
    """Per rank, over every step but the first: each stage's host time per call (a call: one layer and micro-batch),
    longest first, as {rank: [(stage, mean ms, calls)]}; empty without host spans."""
    first = min((r["step"] for r in rows), default=None)
    sums = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    for r in rows:
        if r["step"] == first or not r["host"]:
            continue
        for stage, v in r["host"]["stages"].items():
            sums[r["rank"]][stage][0] += v["ms"]
            sums[r["rank"]][stage][1] += v["count"]
    return {rank: sorted(((st, ms / n, n) for st, (ms, n) in per.items()), key=lambda x: -x[1])
            for rank, per in sorted(sums.items())}


def span_text(values):
    """'0-3' for 0, 1, 2, 3; '2' for one value."""
    return "%d" % values[0] if len(values) == 1 else "%d-%d" % (values[0], values[-1])


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--ranks", type=int, default=None, help="the first R ranks only")
    ap.add_argument("--json", action="store_true", help="print the summaries as JSON")
    ap.add_argument("--host", action="store_true",
                    help="the host's time per stage and backward part too, the --top N longest per rank and step")
    ap.add_argument("--kernels", action="store_true",
                    help="the kernels of a `moert run --trace-kernels` trace too (after the steps)")
    ap.add_argument("--against", metavar="TRACE", default=None,
                    help="with --kernels: each kernel's mean call in another kernel trace too (e.g. the overlap off)")
    ap.add_argument("--top", type=int, default=12,
                    help="with --kernels: the kernels listed per rank; with --host: the stages listed per step")
    ap.add_argument("--gaps", action="store_true",
                    help="with --kernels: where the GPU ran no kernel (gaps of --min-gap us or more), by stage")
    ap.add_argument("--min-gap", type=float, default=20.0, help="with --gaps: the shortest gap counted, us (20)")
    a = ap.parse_args(argv)
    ks = against = gs = None
    try:
        with open(a.trace, encoding="utf-8") as f:
            trace = json.load(f)
        rows = summarize(trace, a.ranks)
        if a.kernels:
            ks = kernel_summary(trace, rows, a.top)
            if not ks:
                raise ValueError("no kernels in the trace (`moert run --trace FILE --trace-kernels` records them)")
            if a.gaps:
                gs = gap_summary(trace, rows, a.min_gap, a.top)
            if a.against:
                with open(a.against, encoding="utf-8") as f:
                    other = json.load(f)
                against = kernel_summary(other, summarize(other, a.ranks), a.top)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print("trace_summary: %s: %s" % (a.trace, e), file=sys.stderr)
        return 2
    if a.json:
        json.dump({"steps": rows, "kernels": ks, "gaps": gs} if a.kernels else rows, sys.stdout, indent=1)
        print()
        return 0
    for r in rows:
        streams = ", ".join("%s %.2f" % (s, ms) for s, ms in r["streams_ms"].items())
        print("rank %d step %d: span %.2f ms, idle %.2f ms, communication alone %.2f ms; busy: %s" %
              (r["rank"], r["step"], r["span_ms"], r["idle_ms"], r["communication_alone_ms"], streams))
        if r["merged"]:
            m = r["merged"]
            print("  merged halves %.2f ms: %.2f ms per layer and micro-batch; first forward alone %.2f ms, last "
                  "backward alone %.2f ms" % (m["window_ms"], m["per_layer_micro_batch_ms"],
                                              m["first_forward_alone_ms"], m["last_backward_alone_ms"]))
        for c, v in r["dispatcher_calls"].items():
            print("  dispatcher.%-17s x%-3d own %8.2f ms, its stage %8.2f ms, waited %8.2f ms" %
                  (c, v["count"], v["call_ms"], v["stage_ms"], v["stage_ms"] - v["call_ms"]))
        if r["host"]:
            h = r["host"]
            print("  host: in the layers %.2f ms; in dispatcher calls: %s" %
                  (h["in_layers_ms"], ", ".join("%s %.2f" % kv for kv in h["dispatcher_calls_ms"].items()) or "-"))
            if a.host:
                print("  host per stage: %s" % ", ".join("%s %.2f ms x%d" % (st, v["ms"], v["count"])
                                                         for st, v in list(h["stages"].items())[:a.top]))
    if a.host:
        for rank, means in host_means(rows).items():
            print("host per call, rank %d, every step but the first: %s" %
                  (rank, ", ".join("%s %.3f ms x%d" % m for m in means[:a.top])))
    if ks:
        print_kernels(ks, a.top, against)
    if gs:
        print_gaps(gs)
    steady = steady_state(rows)
    if steady:
        lo, hi, median, ranks, steps = steady
        print("steady state: %.2f-%.2f ms per layer and micro-batch, median %.2f (merged halves, ranks %s, steps %s)" %
              (lo, hi, median, span_text(ranks), span_text(steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
