#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `moert run --trace FILE`: a Chrome trace of every rank's stage spans. Checks that it is valid JSON with, for each rank,
# every forward stage and backward part of every layer in every micro-batch of every step, in order on the compute
# stream (no two spans of one rank's compute stream overlap, each layer's stages follow each other), and that the
# trace's path is checked before the run like --report's; and with micro-batch overlap, slot 1's streams.
# Usage: test_trace.sh PATH/TO/moert
set -u
moert="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
run_dir="$tmp"
. "$(dirname "$0")/cli_lib.sh"

cat >"$tmp/c.json" <<JSON
{"model": {"hidden": 16, "ffn_hidden": 32, "num_experts": 4, "topk": 2, "num_layers": 2},
 "parallel": {"ranks": 2, "device": "cpu"}, "train": {"steps": 3, "tokens_per_rank": 32, "micro_batches": 2}}
JSON
run traced 0 run c.json --trace t.json --quiet
python3 - "$tmp/t.json" <<'PY' || fail "trace content"
import collections, json, sys
d = json.load(open(sys.argv[1]))
spans = [e for e in d["traceEvents"] if e["ph"] == "X"]
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e["name"] == "thread_name"}
stages = ["router", "permute", "dispatch", "fc1", "act", "fc2", "combine"]
parts = ["combine_bwd", "fc2_dgrad", "fc2_wgrad", "act_bwd", "fc1_dgrad", "fc1_wgrad", "dispatch_bwd", "router_bwd"]
per = collections.defaultdict(list)
for e in spans:
    per[(e["pid"], e["args"]["step"], e["args"]["micro_batch"], e["args"]["layer"])].append(e)
keys = {(r, s, m, l) for r in (0, 1) for s in (1, 2, 3) for m in (0, 1) for l in (0, 1)}
assert set(per) == keys, sorted(set(per) ^ keys)
host = collections.defaultdict(list)  # the host's spans (API version 10), on their own row
for k in list(per):
    host[k] = [e for e in per[k] if names[(e["pid"], e["tid"])] == "host"]
    per[k] = [e for e in per[k] if names[(e["pid"], e["tid"])] != "host"]
for k, es in per.items():
    got = [e["name"].split(" ", 1)[1] for e in es]
    for n in stages + parts:
        assert n in got, (k, n, got)
    # on the CPU the host runs the work: a host span per span of the streams, at the same time
    hs = {(e["name"], round(e["ts"]), round(e["dur"])) for e in host[k]}
    assert len(host[k]) == len(es), (k, len(host[k]), len(es))
    assert hs == {(e["name"], round(e["ts"]), round(e["dur"])) for e in es}, (k, hs)
    fwd = [e for e in es if e["name"].split(" ", 1)[1] in stages]
    for a, b in zip(fwd, fwd[1:]):  # stages back to back
        assert abs(a["ts"] + a["dur"] - b["ts"]) < 1.0, (k, a, b)
for (pid, tid), stream in names.items():  # one rank's compute stream runs one span at a time
    es = sorted((e for e in spans if e["pid"] == pid and e["tid"] == tid), key=lambda e: e["ts"])
    if stream == "compute":
        for a, b in zip(es, es[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (a, b)
# each dispatcher call's own span, on the "dispatcher" track, inside its stage's span on the compute stream
inside = {"prepare": "permute", "dispatch": "dispatch", "combine": "combine", "combine_backward": "combine_bwd",
          "dispatch_backward": "dispatch_bwd"}
for k, es in per.items():
    by = {e["name"].split(" ", 1)[1]: e for e in es}
    for call, stage in inside.items():
        c = by["dispatcher." + call]
        assert names[(c["pid"], c["tid"])] == "dispatcher", (k, c)
        s = by[stage]
        assert s["ts"] - 1.0 <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"] + 1.0, (k, call, c, s)
print("trace ok: %d spans" % len(spans))
PY
# micro-batch overlap ($.parallel.overlap_micro_batches): slot 1's micro-batches on the streams "compute.1" (and
# "wgrad.1"); every micro-batch's spans are there, and each compute stream runs one span at a time
run traced_overlap 0 run c.json --trace to.json --quiet --set train.micro_batches=3 \
    --set 'parallel.overlap_micro_batches="on"'
python3 - "$tmp/to.json" <<'PY' || fail "overlap trace content"
import collections, json, sys
d = json.load(open(sys.argv[1]))
spans = [e for e in d["traceEvents"] if e["ph"] == "X"]
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e["name"] == "thread_name"}
assert {"compute", "compute.1"} <= set(names.values()), names
per = collections.defaultdict(list)
for e in spans:
    per[(e["pid"], e["args"]["step"], e["args"]["micro_batch"], e["args"]["layer"])].append(e)
keys = {(r, s, m, l) for r in (0, 1) for s in (1, 2, 3) for m in (0, 1, 2) for l in (0, 1)}
assert set(per) == keys, sorted(set(per) ^ keys)
for k, es in per.items():
    want = "compute.1" if k[2] % 2 else "compute"
    assert {names[(e["pid"], e["tid"])] for e in es} <= {want, want.replace("compute", "wgrad"), "dispatcher",
                                                         want.replace("compute", "host")}, (k, want)
    assert any(names[(e["pid"], e["tid"])] == want.replace("compute", "host") for e in es), (k, "host spans")
    assert sum(e["name"].endswith(" dispatcher.dispatch") and not names[(e["pid"], e["tid"])].startswith("host")
               for e in es) == 1, k
for (pid, tid), stream in names.items():
    es = sorted((e for e in spans if e["pid"] == pid and e["tid"] == tid), key=lambda e: e["ts"])
    if stream.startswith("compute"):
        for a, b in zip(es, es[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (a, b)
print("overlap trace ok: %d spans" % len(spans))
PY
# summed up per rank and step (tools/trace_summary.py): every dispatcher call of every layer and micro-batch counted,
# each call's own time within its stage's; a file that is no trace is refused with exit status 2
src="${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
python3 "$src/tools/trace_summary.py" "$tmp/to.json" --json >"$tmp/sum.json" || fail "trace_summary: exit $?"
python3 - "$tmp/sum.json" <<'PY' || fail "trace_summary content"
import json, sys
rows = json.load(open(sys.argv[1]))
assert {(r["rank"], r["step"]) for r in rows} == {(r, s) for r in (0, 1) for s in (1, 2, 3)}, rows
for r in rows:
    assert 0 <= r["idle_ms"] <= r["span_ms"] and 0 <= r["communication_alone_ms"] <= r["span_ms"], r
    m = r["merged"]  # the overlap's merged halves: micro-batches 1..2's forwards with 0..1's backwards, 2 layers
    assert m and 0 < m["window_ms"] < r["span_ms"], r
    assert abs(m["per_layer_micro_batch_ms"] * 2 * 2 - m["window_ms"]) < 1e-9, m
    assert m["first_forward_alone_ms"] > 0 and m["last_backward_alone_ms"] > 0, m
    assert set(r["dispatcher_calls"]) == {"prepare", "dispatch", "combine", "combine_backward", "dispatch_backward"}
    for c, v in r["dispatcher_calls"].items():
        assert v["count"] == 2 * 3 and 0 <= v["call_ms"] <= v["stage_ms"] + 1e-3, (c, v)
    h = r["host"]  # the host's spans, kept out of the streams' figures above
    assert h and 0 < h["in_layers_ms"] <= r["span_ms"] + 1e-3, (r, h)
    assert list(h["dispatcher_calls_ms"]) == list(r["dispatcher_calls"]), h
    for c, ms in h["dispatcher_calls_ms"].items():  # on the CPU the host runs the call: its time is the call's
        assert abs(ms - r["dispatcher_calls"][c]["call_ms"]) < 1e-2, (c, ms, r["dispatcher_calls"][c])
    assert "host" not in r["streams_ms"] and "host.1" not in r["streams_ms"], r["streams_ms"]
print("trace summary ok")
PY
# the host's time per stage (--host): on the CPU the host runs each stage, so a stage's host time summed over layers
# and micro-batches is the sum of its spans on the streams (and the dispatcher row), as read here from the trace
python3 - "$tmp/sum.json" "$tmp/to.json" <<'PY' || fail "trace_summary host per stage"
import collections, json, sys
rows = json.load(open(sys.argv[1]))
d = json.load(open(sys.argv[2]))
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"}
want = collections.defaultdict(float)
for e in d["traceEvents"]:
    if e.get("ph") == "X" and e.get("cat") != "kernel" and not names[(e["pid"], e["tid"])].startswith("host"):
        want[(e["pid"], e["args"]["step"], e["name"].split(" ", 1)[1])] += e["dur"] / 1e3
for r in rows:
    st = r["host"]["stages"]
    assert {"router", "fc1", "fc2_wgrad", "dispatcher.prepare"} <= set(st), st
    ms = [v["ms"] for v in st.values()]
    assert ms == sorted(ms, reverse=True), st  # longest first
    for stage, v in st.items():
        assert v["count"] > 0 and abs(v["ms"] - want[(r["rank"], r["step"], stage)]) < 1e-2, (r["rank"], stage, v)
print("host per stage ok")
PY
python3 "$src/tools/trace_summary.py" "$tmp/to.json" --ranks 1 --host --top 3 >"$tmp/host.txt" ||
    fail "trace_summary --host: exit $?"
python3 - "$tmp/sum.json" "$tmp/host.txt" <<'PY' || fail "trace_summary --host text"
import json, sys
first = [r for r in json.load(open(sys.argv[1])) if r["rank"] == 0][0]
top = list(first["host"]["stages"].items())[:3]
want = "  host per stage: " + ", ".join("%s %.2f ms x%d" % (s, v["ms"], v["count"]) for s, v in top)
lines = [l for l in open(sys.argv[2]).read().splitlines() if l.startswith("  host per stage: ")]
assert len(lines) == 3 and lines[0] == want, (lines, want)  # one per step of rank 0, the 3 longest
# after the steps: per call over steps 2-3, the longest first
rows = [r for r in json.load(open(sys.argv[1])) if r["rank"] == 0 and r["step"] >= 2]
means = {}
for st in rows[0]["host"]["stages"]:
    ms = sum(r["host"]["stages"][st]["ms"] for r in rows)
    n = sum(r["host"]["stages"][st]["count"] for r in rows)
    means[st] = (ms / n, n)
top = sorted(means.items(), key=lambda kv: -kv[1][0])[:3]
want = "host per call, rank 0, every step but the first: " + ", ".join("%s %.3f ms x%d" % (s, m, n) for s, (m, n) in top)
last = [l for l in open(sys.argv[2]).read().splitlines() if l.startswith("host per call, rank 0")]
assert last == [want], (last, want)
PY
python3 "$src/tools/trace_summary.py" "$tmp/to.json" --ranks 1 >"$tmp/sum.txt" || fail "trace_summary text: exit $?"
grep -q "dispatcher.dispatch " "$tmp/sum.txt" || fail "trace_summary text"
# the last line: the range of the merged halves per layer and micro-batch over steps 2-3 of rank 0, as in the JSON
python3 - "$tmp/sum.json" "$tmp/sum.txt" <<'PY' || fail "trace_summary steady state"
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["rank"] == 0 and r["step"] >= 2]
per = sorted(r["merged"]["per_layer_micro_batch_ms"] for r in rows)
median = per[len(per) // 2] if len(per) % 2 else (per[len(per) // 2 - 1] + per[len(per) // 2]) / 2
want = ("steady state: %.2f-%.2f ms per layer and micro-batch, median %.2f (merged halves, ranks 0, steps 2-3)" %
        (per[0], per[-1], median))
last = open(sys.argv[2]).read().splitlines()[-1]
assert last == want, (last, want)
PY
# kernels (`--trace-kernels`, GPU runs): three synthetic kernels put into each step window of rank 0 of the overlap
# trace, A [0, 100) us, B [50, 150) and C [300, 400), and a kernel outside every window; --kernels counts per step
# (steps 2-3) A and B 50 us alone each and 50 us together, C 100 us alone; two at once 50 us, one 200 us
python3 - "$tmp/to.json" "$tmp/sum.json" "$tmp/tk.json" <<'PY' || fail "kernel trace fixture"
import json, sys
d, rows = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
ev = d["traceEvents"]
ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 100, "args": {"name": "kernels, CUDA stream 7"}})
def kernel(name, ts, dur):
    ev.append({"name": name, "cat": "kernel", "ph": "X", "pid": 0, "tid": 100, "ts": ts, "dur": dur,
               "args": {"kernel": "_Z1" + name, "grid": 132, "cuda_stream": 7}})
for r in rows:
    if r["rank"] == 0:
        lo = r["window_us"][0]
        kernel("A", lo, 100.0); kernel("B", lo + 50.0, 100.0); kernel("C", lo + 300.0, 100.0)
kernel("late", max(r["window_us"][1] for r in rows) + 1e6, 5.0)
json.dump(d, open(sys.argv[3], "w"))
PY
python3 "$src/tools/trace_summary.py" "$tmp/tk.json" --kernels --json >"$tmp/ks.json" || fail "trace_summary --kernels"
python3 - "$tmp/ks.json" <<'PY' || fail "trace_summary --kernels content"
import json, sys
k = json.load(open(sys.argv[1]))["kernels"]["0"]
near = lambda a, b: abs(a - b) < 1e-6
assert k["steps"] == 2, k["steps"]
by = {x["name"]: x for x in k["kernels"]}
assert set(by) == {"A", "B", "C"}, sorted(by)
for n, alone in (("A", 0.05), ("B", 0.05), ("C", 0.1)):
    assert near(by[n]["calls"], 1) and near(by[n]["ms"], 0.1) and near(by[n]["alone_ms"], alone), by[n]
assert near(k["running_ms"]["2"], 0.05) and near(k["running_ms"]["1"], 0.2), k["running_ms"]
assert near(k["running_ms"]["0"] + 0.25, k["window_ms"]), k
assert k["together"] == [{"names": ["A", "B"], "ms": k["together"][0]["ms"]}] and near(k["together"][0]["ms"], 0.05)
PY
# --gaps: per step one gap with no kernel, B's end to C's start (150 us), found between B and C
python3 "$src/tools/trace_summary.py" "$tmp/tk.json" --kernels --gaps --json >"$tmp/gs.json" || fail "trace_summary --gaps"
python3 - "$tmp/gs.json" "$tmp/tk.json" "$tmp/sum.json" <<'PY' || fail "trace_summary --gaps content"
import json, sys
g = json.load(open(sys.argv[1]))["gaps"]["0"]
assert g["steps"] == 2 and abs(g["idle_ms"] - 0.15) < 1e-6, g
# grouped by the stage running at its middle, which differs from step to step
assert all(x["after"] == "B" and x["before"] == "C" for x in g["gaps"]), g
assert abs(sum(x["count"] for x in g["gaps"]) - 1) < 1e-9 and abs(sum(x["ms"] for x in g["gaps"]) - 0.15) < 1e-6, g
# and by what the host did at its middle: its shortest span there, found here from the trace's host rows
d = json.load(open(sys.argv[2]))
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in d["traceEvents"] if e.get("name") == "thread_name"}
host = [e for e in d["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0
        and names.get((0, e["tid"]), "").startswith("host")]
rows = [r for r in json.load(open(sys.argv[3])) if r["rank"] == 0 and r["step"] >= 2]
want = {}
for r in rows:
    mid = r["window_us"][0] + 225.0  # B ends at 150 us, C starts at 300
    inner = min((e for e in host if e["ts"] <= mid <= e["ts"] + e["dur"]), key=lambda e: e["dur"], default=None)
    doing = inner["name"].split(" ", 1)[1] if inner else "-"
    want[doing] = want.get(doing, 0) + 0.5
got = {}
for x in g["gaps"]:
    got[x["host"]] = got.get(x["host"], 0) + x["count"]
assert got.keys() == want.keys() and all(abs(got[h] - want[h]) < 1e-9 for h in want), (g, want)
assert any(x["host"] != "-" for x in g["gaps"]), g
PY
python3 "$src/tools/trace_summary.py" "$tmp/tk.json" --kernels --gaps --min-gap 200 --json >"$tmp/gs2.json" &&
    python3 -c "import json,sys; g=json.load(open(sys.argv[1]))['gaps']['0']; assert g['idle_ms'] == 0 and not g['gaps'], g" \
        "$tmp/gs2.json" || fail "trace_summary --min-gap 200 counted a 150 us gap"
python3 "$src/tools/trace_summary.py" "$tmp/tk.json" --kernels --against "$tmp/tk.json" >"$tmp/ks.txt" ||
    fail "trace_summary --kernels --against"
grep -qE "^  A +1\.0 +0\.100 +0\.050 +100\.0 +100\.0 +1\.000$" "$tmp/ks.txt" || fail "trace_summary --against: $(cat "$tmp/ks.txt")"
python3 "$src/tools/trace_summary.py" "$tmp/to.json" --kernels 2>"$tmp/nok.err"
[ $? -eq 2 ] && grep -q "no kernels in the trace" "$tmp/nok.err" || fail "trace_summary: --kernels without kernels"
echo '{"traceEvents": []}' >"$tmp/empty.json"
python3 "$src/tools/trace_summary.py" "$tmp/empty.json" 2>"$tmp/sum.err"
[ $? -eq 2 ] && grep -q "no spans" "$tmp/sum.err" || fail "trace_summary: an empty trace not refused"
# drawn without a browser (matplotlib, which CI installs)
py=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x /usr/bin/python3 ] && py=/usr/bin/python3 # the distribution's, with its matplotlib
if "$py" "$src/tools/trace_plot.py" "$tmp/t.json" "$tmp/t.png" --step 2 2>"$tmp/plot.err"; then
    [ "$(head -c 4 "$tmp/t.png" | od -An -c | tr -d ' ')" = "211PNG" ] || fail "trace_plot: not a PNG"
else
    fail "trace_plot: $(cat "$tmp/plot.err")"
fi
"$py" "$src/tools/trace_plot.py" "$tmp/t.json" "$tmp/t9.png" --step 9 2>"$tmp/plot9.err" && fail "trace_plot: step 9 drawn"
# the kernels' lanes (the synthetic kernel trace above), zoomed; a window with nothing in it, and no kernels, refused
"$py" "$src/tools/trace_plot.py" "$tmp/tk.json" "$tmp/tk.png" --step 2 --ranks 1 --kernels --window 0 1 \
    2>"$tmp/plotk.err" || fail "trace_plot --kernels: $(cat "$tmp/plotk.err")"
[ "$(head -c 4 "$tmp/tk.png" 2>/dev/null | od -An -c | tr -d ' ')" = "211PNG" ] || fail "trace_plot --kernels: not a PNG"
"$py" "$src/tools/trace_plot.py" "$tmp/tk.json" "$tmp/tw.png" --step 2 --kernels --window 1e9 2e9 2>"$tmp/plotw.err" &&
    fail "trace_plot: an empty window drawn"
grep -q "nothing runs in --window" "$tmp/plotw.err" || fail "trace_plot: no message for an empty window"
"$py" "$src/tools/trace_plot.py" "$tmp/t.json" "$tmp/tn.png" --step 2 --kernels 2>"$tmp/plotn.err" &&
    fail "trace_plot: --kernels drawn without kernels"
grep -q "no kernels in step 2" "$tmp/plotn.err" || fail "trace_plot: no message for --kernels without kernels"
grep -q "step 9 is not in the trace" "$tmp/plot9.err" || fail "trace_plot: no message for a missing step"
# the trace's path is checked before the run: never the config
cp "$tmp/c.json" "$tmp/c.orig"
run onto_config 1 run c.json --trace c.json
expect_match onto_config err "--trace c.json is the input c.json"
cmp -s "$tmp/c.json" "$tmp/c.orig" || fail "onto_config: the config was changed"
run same_file 1 run c.json --trace o.json --report o.json
expect_match same_file err "--report and --trace name the same file"
# --trace-kernels (CUPTI) adds the GPU's kernels to a trace: refused without --trace, and on a CPU run, before it runs
run kernels_alone 2 run c.json --trace-kernels
expect_match kernels_alone err "--trace-kernels adds CUDA kernels to a trace: it needs --trace FILE"
run kernels_cpu 1 run c.json --trace k.json --trace-kernels
expect_match kernels_cpu err "--trace-kernels records CUDA kernels, and this run is on the CPU"
[ -e "$tmp/k.json" ] && fail "kernels_cpu: a trace was written"

if [ "$failures" -ne 0 ]; then echo "test_trace: $failures check(s) failed" >&2; exit 1; fi
echo "test_trace: all checks passed"
