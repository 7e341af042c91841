#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `moert ab`: keep vs recompute+offload agree bit for bit and B keeps fewer bytes; a different model is
# refused naming the key; the JSON report holds both sides and the ratios; the plot's data and, with matplotlib, its PNG.
# Usage: test_ab.sh PATH/TO/moert
set -u
moert="$1"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/cli_lib.sh"

# A tiny model: two configs that differ only in the memory policy (and the name)
model='"model": {"hidden": 16, "ffn_hidden": 24, "num_experts": 4, "topk": 2, "num_layers": 2},
 "parallel": {"ranks": 2}, "train": {"tokens_per_rank": 32, "seed": 3, "lr": 0.01, "steps": 6}'
echo "{\"name\": \"keep\", $model}" >"$tmp/keep.json"
echo "{\"name\": \"saver\", $model, \"memory_policy\": {\"dispatched_x\": \"offload\", \"fc1_out\": \"recompute\",
 \"swiglu_out\": \"recompute\"}}" >"$tmp/saver.json"

# keep vs recompute+offload: identical losses, fewer bytes kept by B. --plot draws with python3 and matplotlib where
# they are (exit 0), and otherwise fails saying what is missing (exit 1), after the report and the plot's data
# (moert takes the python3 on PATH, else /usr/bin/python3, whichever imports matplotlib first)
plot_python=
for p in python3 /usr/bin/python3; do
    if [ -z "$plot_python" ] && "$p" -c 'import matplotlib' 2>/dev/null; then plot_python=$p; fi
done
if [ -n "$plot_python" ]; then have_matplotlib=1; else have_matplotlib=0; fi
run policy $((1 - have_matplotlib)) ab "$tmp/keep.json" "$tmp/saver.json" --warmup 2 --report "$tmp/report.json" \
    --plot "$tmp/plot.png"
expect_match policy out '^moert ab: A "keep" \(.*/keep\.json\) vs B "saver" \(.*/saver\.json\)$'
expect_match policy out '^  same in both: router topk, dispatcher alltoall, precision bf16$'
expect_match policy out '^  differs: memory_policy: A \{"plugin":"default"\}, B \{.*"fc1_out":"recompute".*\}$'
expect_line policy out "  2 warm-up steps, then 6 measured steps, interleaved ABBA: A first on odd steps, B on even ones"
expect_match policy out '^figure +A median \[p10-p90\] +B median \[p10-p90\] +B/A$'
expect_match policy out '^layer fwd\+bwd \(ms\) +[0-9.]+ \[[0-9.]+-[0-9.]+\] +[0-9.]+ \[[0-9.]+-[0-9.]+\] +[0-9.]+$'
expect_match policy out '^kept fwd->bwd \(rank 0\) +[0-9.]+ KiB +0 B +0\.000$'
expect_match policy out '^outputs agree: yes \(max relative loss difference 0\.0e\+00 over 8 steps, identical; first step: output 0\.0e\+00, gradients 0\.0e\+00; rtol 0\.01 declared by precision bf16\)$'
expect_match policy out '^summary: B/A step time [0-9.]+x.*activations kept 0\.00x; outputs agree$'
expect_match policy out '^timing \(B/A, ABBA order, bootstrap over 6 paired steps\): step (B (faster|slower) by [0-9.]+% \(95% CI [0-9.]+% to [0-9.]+%\)|no difference detected \(95% CI [-+][0-9.]+% to [-+][0-9.]+%\)); layer fwd\+bwd .*$'
[ -f "$tmp/report.md" ] || fail "policy: no Markdown report beside the JSON"
grep -qF '| figure | A median [p10-p90] | B median [p10-p90] | B/A |' "$tmp/report.md" 2>/dev/null ||
    fail "policy: report.md lacks the table header"

# the JSON report: both sides, every step, the ratios and the verdict
python3 - "$tmp/report.json" <<'EOF' || fail "policy: the JSON report is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
figures = ["step", "router", "permute", "dispatch", "fc1", "act", "fc2", "combine", "backward", "layer"]
ok = True
def check(cond, what):
    global ok
    if not cond:
        print("report:", what, file=sys.stderr)
        ok = False
check(r["warmup_steps"] == 2 and r["measured_steps"] == 6, "step counts")
check(r["differing_plugin_sections"] == ["memory_policy"], "differing sections")
for side in ("a", "b"):
    s = r[side]
    check(len(s["steps"]) == 8 and [x["warmup"] for x in s["steps"]] == [True] * 2 + [False] * 6, side + " steps")
    check(all(f in s["ms"] and s["ms"][f]["p10"] <= s["ms"][f]["median"] <= s["ms"][f]["p90"] for f in figures),
          side + " medians and spreads")
check(r["a"]["name"] == "keep" and r["b"]["name"] == "saver", "names")
check(r["b"]["plugins"]["memory_policy"]["fc1_out"] == "recompute", "B's memory policy")
check([x["loss"] for x in r["a"]["steps"]] == [x["loss"] for x in r["b"]["steps"]], "losses equal")
ka = r["a"]["activation_bytes_rank0"]["kept_from_forward_to_backward"]
kb = r["b"]["activation_bytes_rank0"]["kept_from_forward_to_backward"]
check(ka > 0 and kb < ka, "kept bytes %d (A) vs %d (B)" % (ka, kb))
check(all(f in r["b_over_a"] for f in figures), "ratios")
m = r["a"]["ms"]["step"]["median"]
check(m > 0 and abs(r["b_over_a"]["step"] - r["b"]["ms"]["step"]["median"] / m) < 1e-6 * r["b_over_a"]["step"],
      "step ratio is B's median over A's")
check(r["b_over_a"]["kept_from_forward_to_backward"] == kb / ka, "kept ratio")
iv = r["b_over_a_intervals"]
st = iv["figures"]["step"]
check(iv["order"] == "ABBA" and iv["seed"] > 0 and st["ci_low"] <= st["ratio"] <= st["ci_high"] and st["pairs"] == 6
      and abs(st["ratio"] - r["b_over_a"]["step"]) < 1e-6 * st["ratio"], "the step's interval")
ag = r["agreement"]
check(ag["agree"] is True and ag["losses_identical"] is True and ag["loss_max_relative_difference"] == 0, "agreement")
check(ag["first_step"]["compared"] is True and ag["first_step"]["gradient_max_relative_difference"] == 0, "first step")
sys.exit(0 if ok else 1)
EOF

# the plot's data: both sides, every step, the warm-up, and what B changes (the legend's title)
python3 - "$tmp/plot.plot.json" <<'EOF' || fail "plot: bad data file"
import json, sys
d = json.load(open(sys.argv[1]))
assert [s["label"] for s in d["sides"]] == ["A: keep", "B: saver"], d["sides"]
assert len({len(s["step_ms"]) for s in d["sides"]} | {len(s["loss"]) for s in d["sides"]}) == 1, "steps"
assert d["warmup"] == 2 and d["differs"][0].startswith("memory_policy: A "), d["differs"]
assert d["sides"][0]["loss"] == d["sides"][1]["loss"], "identical losses"
EOF
if [ "$have_matplotlib" = 1 ]; then
    # a 900 x 640 PNG with A's blue and B's orange lines in it
    [ "$(od -An -tx1 -N16 "$tmp/plot.png" | tr -d ' \n')" = "89504e470d0a1a0a0000000d49484452" ] ||
        fail "plot: no PNG signature followed by an IHDR chunk"
    "$plot_python" - "$tmp/plot.png" <<'EOF' || fail "plot: not the expected image"
import sys
import matplotlib.image
img = matplotlib.image.imread(sys.argv[1])
assert img.shape[:2] == (640, 900), img.shape
colors = {tuple(int(round(c * 255)) for c in px[:3]) for row in img[::3] for px in row[::3]}
assert (31, 119, 180) in colors and (255, 127, 14) in colors, "no line of A or B"
EOF
else
    [ ! -e "$tmp/plot.png" ] || fail "plot: a PNG was written without matplotlib"
    expect_match policy err "^moert ab: --plot needs the Python module matplotlib \(Debian/Ubuntu: apt-get install python3-matplotlib\); the data is in $tmp/plot\.plot\.json"
fi

# a different model is not an A/B: every differing key is named with both values, exit status 2
run model 2 ab "$tmp/keep.json" "$tmp/saver.json" --set-b model.hidden=32 --set-b train.seed=4
expect_line model err 'moert ab: not an A/B: $.model.hidden is 16 in A and 32 in B'
expect_line model err 'moert ab: not an A/B: $.train.seed is 3 in A and 4 in B'
run micro 2 ab "$tmp/keep.json" "$tmp/saver.json" --set-b train.micro_batches=2
expect_line micro err 'moert ab: not an A/B: $.train.micro_batches is 1 in A and 2 in B'
[ -s "$tmp/model.out" ] && fail "model: a refused A/B printed on stdout"
# --set applies to both sides: the same change on both is still an A/B
run both 0 ab "$tmp/keep.json" "$tmp/saver.json" --set model.hidden=8 --warmup 0 --steps 1 --quiet
expect_match both out '^outputs agree: yes'
# micro-batches on both sides: the header says so, the outputs still agree (the policies change memory only)
run micro2 0 ab "$tmp/keep.json" "$tmp/saver.json" --set train.micro_batches=2 --warmup 0 --steps 2
expect_match micro2 out 'tokens per rank x 2 micro-batches per step \(times per step\)'
expect_match micro2 out '^outputs agree: yes'
grep -q '^micro-batch overlap:' "$tmp/micro2.out" && fail "micro2: an overlap note though neither side overlaps"
# the micro-batch overlap on one side: the same losses, and a note that its stage figures overlap in time
run mbo 0 ab "$tmp/keep.json" "$tmp/keep.json" --set train.micro_batches=2 --set-b 'parallel.overlap_micro_batches="on"' \
    --warmup 0 --steps 2
expect_match mbo out '^outputs agree: yes'
expect_match mbo out '^micro-batch overlap: A off, B on; with it on, a stage.s figure .* compare the step'
# a differing learning rate is allowed, said in the header, and the losses then differ
run lr 0 ab "$tmp/keep.json" "$tmp/saver.json" --set-b train.lr=0.05 --warmup 1 --steps 3
expect_line lr out "  differs: train.lr 0.01 in A, 0.05 in B"
expect_match lr out '^outputs agree: no \(max relative loss difference [0-9.]+e-[0-9]+ \(step [2-4]\) over 4 steps; first step: output 0\.0e\+00, gradients 0\.0e\+00; rtol 0\.01 declared by precision bf16\)$'

# the wgrad overlap changes only where the wgrads run: the same losses bit for bit, said in the header; the backward's
# parts get rows, and the JSON steps carry them
run overlap 0 ab "$tmp/keep.json" "$tmp/keep.json" --set-a parallel.overlap_wgrad=false --warmup 1 --steps 3 \
    --report "$tmp/overlap.json"
expect_line overlap out "  differs: parallel.overlap_wgrad: A false, B true"
expect_match overlap out '^outputs agree: yes \(max relative loss difference 0\.0e\+00 over 4 steps, identical; first step: output 0\.0e\+00, gradients 0\.0e\+00; rtol 0\.01 declared by precision bf16\)$'
expect_match overlap out '^backward: fc1_wgrad \(ms\) +[0-9.]+ \[[0-9.]+-[0-9.]+\] +[0-9.]+ \[[0-9.]+-[0-9.]+\] +[0-9.]+$'
expect_match overlap out '^backward: dispatch_bwd \(ms\) '
grep -q '^backward: recompute' "$tmp/overlap.out" && fail "overlap: a recompute row though neither side recomputes"
python3 - "$tmp/overlap.json" <<'EOF' || fail "overlap: the JSON steps lack the backward parts"
import json, sys
r = json.load(open(sys.argv[1]))
for side in "ab":
    for st in r[side]["steps"]:
        p = st["backward_parts_ms_rank0"]
        assert set(p) == {"recompute", "combine_bwd", "fc2_dgrad", "fc2_wgrad", "act_bwd", "fc1_dgrad", "fc1_wgrad",
                          "dispatch_bwd", "router_bwd", "wgrad_wait"}, p
        assert p["recompute"] == 0 and p["wgrad_wait"] == 0, p  # on the CPU nothing is waited for
        assert all(p[k] > 0 for k in ("combine_bwd", "fc2_dgrad", "fc2_wgrad", "fc1_dgrad", "fc1_wgrad")), p
        assert sum(p.values()) <= st["stage_ms_rank0"]["backward"] * 1.0001, (p, st["stage_ms_rank0"])
EOF

# weight gradients past a merged call (GPUs only): the header names the key, the losses stay the same bit for bit
run defer 0 ab "$tmp/keep.json" "$tmp/keep.json" --set-a parallel.defer_wgrad_join=false --warmup 1 --steps 2
expect_line defer out "  differs: parallel.defer_wgrad_join: A false, B true"
expect_match defer out '^outputs agree: yes \(max relative loss difference 0\.0e\+00 over 3 steps, identical;'

# --sequential: A runs to the end and is freed before B starts; the same losses, all of A's progress lines first
run seq 0 ab "$tmp/keep.json" "$tmp/saver.json" --sequential --warmup 1 --steps 3 --report "$tmp/seq.json"
expect_line seq out "  1 warm-up step, then 3 measured steps, sequential: all of A, then all of B (--sequential)"
expect_match seq out '^outputs agree: yes \(max relative loss difference 0\.0e\+00 over 4 steps, identical; first step.s output and gradients not compared when sequential; rtol 0\.01 declared by precision bf16\)$'
expect_match seq out '^kept fwd->bwd \(rank 0\) +[0-9.]+ KiB +0 B +0\.000$'
[ "$(grep -E '^[AB] step' "$tmp/seq.out" | cut -c1 | uniq | tr -d '\n')" = "AB" ] ||
    fail "seq: progress lines are not all of A then all of B"
python3 - "$tmp/seq.json" <<'EOF' || fail "seq: the JSON report's losses differ or lack steps"
import json, sys
r = json.load(open(sys.argv[1]))
la, lb = [x["loss"] for x in r["a"]["steps"]], [x["loss"] for x in r["b"]["steps"]]
sys.exit(0 if len(la) == 4 and la == lb and r["agreement"]["first_step"]["compared"] is False else 1)
EOF

# --rtol overrides the recipes' tolerance; a bf16 against fp8 A/B takes the looser of the two declared (fp8's)
run rtol 0 ab "$tmp/keep.json" "$tmp/keep.json" --warmup 0 --steps 1 --quiet --rtol 1e-3
expect_match rtol out '^outputs agree: yes \(.*; rtol 0\.001 from --rtol\)$'
run fp8 0 ab "$tmp/keep.json" "$tmp/keep.json" --set model.dtype='"bf16"' --set-b 'precision={"plugin":"fp8"}' \
    --warmup 0 --steps 2 --quiet --report "$tmp/fp8.json"
expect_match fp8 out "^outputs agree: (yes|no) \(.*first step: output [0-9.]+e[-+][0-9]+, gradients [0-9.]+e[-+][0-9]+ \(layer [01] [a-z0-9 ]+\); rtol 0\.125, the looser of A's precision bf16 \(0\.01\) and B's fp8 \(0\.125\)\)$"
python3 - "$tmp/fp8.json" <<'EOF' || fail "fp8: the report's tolerance"
import json, sys
ag = json.load(open(sys.argv[1]))["agreement"]
assert ag["rtol"] == 0.125 and ag["rtol_source"].startswith("the looser of A's precision bf16"), ag
assert ag["first_step"]["compared"] is True and ag["first_step"]["gradient_max_relative_difference"] > 0, ag
EOF

# --aa on the demo config: A' (a second copy of A) runs interleaved with A and B; its losses are A's bit for bit, and
# the A'/A interval (the noise floor) stands beside each B/A one in the timing line, the Markdown table and the JSON
demo="${MOERT_TEST_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}/configs/demo-cpu.json"
run aa $((1 - have_matplotlib)) ab "$demo" "$demo" --set train.tokens_per_rank=64 --set-b memory_policy.fc1_out=recompute \
    --aa --warmup 1 --steps 6 --report "$tmp/aa.json" --plot "$tmp/aa.png"
expect_line aa out "  1 warm-up step, then 6 measured steps, interleaved: A, B and A' in each of their 6 orders in turn"
expect_line aa out "  A/A: A' is a second copy of A (--aa); A'/A is the machine's noise floor beside B/A"
expect_match aa out "^step 7/7            A loss [0-9.]+ +[0-9.]+ ms   B loss [0-9.]+ +[0-9.]+ ms   A' loss [0-9.]+ +[0-9.]+ ms$"
expect_match aa out "^A' \(a second copy of A\) agrees with A: yes \(max relative loss difference 0\.0e\+00 over 7 steps, identical; first step: output 0\.0e\+00, gradients 0\.0e\+00; rtol 0\.01 declared by precision bf16\)$"
expect_match aa out "^summary: .*; A'/A step time [0-9.]+x \(the same config twice\)$"
expect_match aa out "^timing \(B/A, A B A' rotating order, bootstrap over 6 paired steps; in brackets A'/A, the noise floor\): step .* \[A'/A 95% CI [-+][0-9.]+% to [-+][0-9.]+%\]; layer fwd\+bwd .* \[A'/A 95% CI [-+][0-9.]+% to [-+][0-9.]+%\]$"
grep -qF "| figure | B/A | 95% CI | verdict | A'/A (noise floor) | A'/A 95% CI |" "$tmp/aa.md" ||
    fail "aa: aa.md lacks the A'/A columns"
python3 - "$tmp/aa.json" <<'EOF' || fail "aa: the JSON report is not as expected"
import json, sys
r = json.load(open(sys.argv[1]))
la, lp = [x["loss"] for x in r["a"]["steps"]], [x["loss"] for x in r["a_prime"]["steps"]]
assert len(la) == 7 and la == lp, (la, lp)
aa, ba = r["a_over_a_intervals"], r["b_over_a_intervals"]
assert aa["order"] == ba["order"] == "A B A' rotating" and aa["seed"] != ba["seed"], (aa, ba)
for f in ("step", "layer"):
    iv = aa["figures"][f]
    assert iv["pairs"] == 6 and iv["ci_low"] <= iv["ratio"] <= iv["ci_high"], iv
ap = r["agreement"]["a_prime"]
assert ap["agree"] and ap["losses_identical"] and ap["first_step"]["compared"], ap
assert ap["first_step"]["output_max_relative_difference"] == 0 and ap["first_step"]["gradient_max_relative_difference"] == 0
assert r["aa_verdict"].startswith("A' (a second copy of A) agrees with A: yes"), r["aa_verdict"]
assert "[A'/A 95% CI" in r["timing"], r["timing"]
EOF
# the plot's data: the three sides, and the step time's B/A and A'/A with their intervals for the distributions' panel
python3 - "$tmp/aa.plot.json" "$tmp/aa.json" <<'EOF' || fail "aa: bad plot data"
import json, sys
d, r = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert [s["label"] for s in d["sides"]] == ["A: demo-cpu", "B: demo-cpu", "A': demo-cpu"], d["sides"]
assert d["step_ratio"]["what"] == "B/A" and d["step_noise"]["what"] == "A'/A", d
assert abs(d["step_noise"]["ci_low"] - r["a_over_a_intervals"]["figures"]["step"]["ci_low"]) < 1e-6, d["step_noise"]
assert d["differs"][0].startswith("memory_policy: A "), d["differs"]
EOF
if [ "$have_matplotlib" = 1 ]; then
    [ -s "$tmp/aa.png" ] || fail "aa: no plot"
fi

# usage errors
run one_config 2 ab "$tmp/keep.json"
expect_line one_config err "usage: moert ab CONFIG_A CONFIG_B [options]"
run bad_steps 2 ab "$tmp/keep.json" "$tmp/saver.json" --steps 0
expect_line bad_steps err 'moert ab: --steps expects an integer from 1 to 100000000, got "0"'
# counts past the bound (or past int64) are refused, not overflowed into an allocation
run huge_warmup 2 ab "$tmp/keep.json" "$tmp/saver.json" --steps 2 --warmup 9223372036854775807
expect_line huge_warmup err 'moert ab: --warmup expects an integer from 0 to 100000000, got "9223372036854775807"'
run bad_set 1 ab "$tmp/keep.json" "$tmp/saver.json" --set-b model.topk=9
expect_line bad_set err 'moert ab (B): --set model.topk=9: config error at $.model.topk: got 9, expected an integer in [1, 4]'

if [ "$failures" -ne 0 ]; then
    echo "test_ab.sh: $failures failure(s)" >&2
    exit 1
fi
echo "test_ab.sh: all passed"
