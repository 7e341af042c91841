#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# DeepEP's intranode dispatch and combine (its public source, built without NVSHMEM by bench/deepep_peer_build.sh)
# beside moert's "deepep" and "hybridep" dispatchers, in one call on NGPU GPUs of one host (4, or 2), at one shape:
#   1. bench/deepep_peer.py under torchrun: DeepEP at SMS SMs (BF16 and FP8 dispatch, BF16 combine) and the token
#      permutation by local expert that Megatron runs after DeepEP's dispatch (and the unpermute before combine)
#   2. BUILD/bench/dispatch_bench: moert's deepep at SMS SMs, its whole call (NVLink phase, then the expansion into
#      expert order: what a layer pays) and its NVLink phase alone, BF16 and FP8 dispatch, BF16 combine; and alltoall
#   3. BUILD/bench/hybridep_bench (MOERT_BENCH_ONLY=normal): hybridep's whole call at SMS SMs and at 16 (its default),
#      BF16 (it has no FP8 dispatch), beside deepep's at 24
# The target: moert's whole dispatch call (which includes the permutation into expert order) at or below DeepEP's
# dispatch + Megatron's permute; each side's figure is the median over calls of the slowest rank's CUDA-event time.
# Writes OUT/deepep-peer-<NGPU>gpu.json (command, machine: the GPUs' nvidia-smi name, date, git revision, DeepEP's
# commit and build, the shape, each step's status and time, both sides' full output, the comparison, a flat results
# list) and OUT/deepep-peer-<NGPU>gpu.log (every step's output), two files (the device machine returns 8 at most),
# and prints the comparison. Exits 1 when a step failed.
#   usage: bench/deepep_peer_gpu.sh BUILD DEEPEP_TGZ OUT [NGPU]       (run in the repo root on the GPU machine)
#     BUILD: a -Dcuda=enabled build tree (bench/dispatch_bench, bench/hybridep_bench, the plugins, build.ninja)
#     DEEPEP_TGZ: OUT/deepep-build.tgz of bench/deepep_peer_build.sh;  NGPU: 4 or 2 (default: 4 if 4 GPUs answer)
#   environment: MOERT_BENCH_GIT (the revision: the device checkout's .git is stale), MOERT_BENCH_MACHINE,
#     PEER_TOKENS (4096), PEER_SMS (24), PEER_ITERS (50), PEER_TIMEOUT / DISPATCH_TIMEOUT / HYBRIDEP_TIMEOUT
#     (130 / 80 / 60 s: each step is killed after its limit, so the script ends within about 300 s)
set -u
usage="usage: bench/deepep_peer_gpu.sh BUILD DEEPEP_TGZ OUT [NGPU]"
BUILD=$(realpath "${1:?$usage}")
DEEPEP_TGZ=$(realpath "${2:?$usage}")
OUT=$(mkdir -p "${3:?$usage}" && realpath "$3")
cd "$(dirname "$0")/.." || exit 2
export PATH=/opt/torch/.venv/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPU=${4:-$([ "${gpus:-0}" -ge 4 ] && echo 4 || echo 2)}
case "$NGPU" in 2 | 4) ;; *) echo "deepep_peer_gpu.sh: NGPU is 2 or 4, not $NGPU" >&2; exit 2 ;; esac
[ "${gpus:-0}" -ge "$NGPU" ] || { echo "deepep_peer_gpu.sh: $NGPU GPUs wanted, ${gpus:-0} answer" >&2; exit 77; }
for exe in dispatch_bench hybridep_bench; do
  [ -x "$BUILD/bench/$exe" ] || { echo "deepep_peer_gpu.sh: $BUILD/bench/$exe is not built" >&2; exit 2; }
done
[ -f "$DEEPEP_TGZ" ] || { echo "deepep_peer_gpu.sh: no $DEEPEP_TGZ" >&2; exit 2; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# MOERT_BENCH_GIT names the revision where the checkout's .git is missing or stale (docs/benchmarks.md)
git=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
machine=${MOERT_BENCH_MACHINE:-$NGPU x $card}
TOKENS=${PEER_TOKENS:-4096} SMS=${PEER_SMS:-24} ITERS=${PEER_ITERS:-50}
devices=$(seq -s, 0 $((NGPU - 1)))
command="bench/deepep_peer_gpu.sh $*"
echo "DeepEP peer: $NGPU x $card, git $git, T $TOKENS, $SMS SMs, $ITERS calls per figure"
WORK=$(mktemp -d /tmp/deepep-peer.XXXXXX)  # the steps' own files; DeepEP's build unpacked in WORK/deepep
trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/deepep-peer-${NGPU}gpu.log
: >"$LOG"

# run NAME LIMIT CMD...: one step under a time limit, its output in WORK/NAME.log (then appended to LOG), its status
# in WORK/steps.txt
run() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit $limit s)"
  timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $((SECONDS - t0))" >>"$WORK/steps.txt"
  { echo "===== $name: rc $rc, $((SECONDS - t0)) s: $*"; cat "$WORK/$name.log"; } >>"$LOG"
  if [ "$rc" -ne 0 ]; then
    echo "   $name: rc $rc$([ "$rc" -ge 124 ] && echo ' (time limit)'); last lines:"
    tail -n 15 "$WORK/$name.log" | sed 's/^/   | /'
  fi
  return 0
}

DEEPEP_DIR=$WORK/deepep
mkdir -p "$DEEPEP_DIR"
run unpack 30 tar -xzf "$DEEPEP_TGZ" -C "$DEEPEP_DIR"

CUDA_VISIBLE_DEVICES=$devices PYTHONPATH=$DEEPEP_DIR${PYTHONPATH:+:$PYTHONPATH} \
  run deepep_peer "${PEER_TIMEOUT:-130}" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  bench/deepep_peer.py --tokens "$TOKENS" --sms "$SMS" --iters "$ITERS" --out "$WORK/peer.json" \
  --machine "$machine" --git "$git"

export MOERT_BENCH_MACHINE=$machine MOERT_BENCH_GIT=$git MOERT_BENCH_REPEATS=$ITERS MOERT_BENCH_TOKENS=$TOKENS
CUDA_VISIBLE_DEVICES=$devices MOERT_BENCH_SMS=$SMS MOERT_BENCH_PHASES=call,nvlink \
  run dispatch_bench "${DISPATCH_TIMEOUT:-80}" "$BUILD/bench/dispatch_bench" "$WORK/dispatch_bench.json"
hyb_limit=${HYBRIDEP_TIMEOUT:-60}
if ! grep -q MOERT_BENCH_SMS "$BUILD/bench/hybridep_bench"; then
  echo "   note: this hybridep_bench predates MOERT_BENCH_ONLY=normal / MOERT_BENCH_SMS: it runs its whole set" \
    "(8/12/16 SMs at T 4096, and the low-latency lines); rebuild for the $SMS-SM line"
  hyb_limit=${HYBRIDEP_TIMEOUT:-120}
fi
CUDA_VISIBLE_DEVICES=$devices MOERT_BENCH_ONLY=normal MOERT_BENCH_SMS="$SMS,16" \
  run hybridep_bench "$hyb_limit" "$BUILD/bench/hybridep_bench" "$WORK/hybridep_bench.json"

"$PY" - "$WORK" "$OUT" "$NGPU" "$card" "$machine" "$git" "$command" "$TOKENS" "$SMS" "$ITERS" "$DEEPEP_DIR" <<'PY'
import datetime, json, os, sys
work, out, ngpu, card, machine, git, command, tokens, sms, iters, deepep_dir = sys.argv[1:12]
ngpu, tokens, sms, iters = int(ngpu), int(tokens), int(sms), int(iters)


def load(name):
    try:
        with open(os.path.join(work, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


steps = []
for line in open(os.path.join(work, "steps.txt")):
    name, rc, secs = line.split()
    steps.append({"step": name, "rc": int(rc), "seconds": int(secs)})
info = {}
try:
    for line in open(os.path.join(deepep_dir, "deepep_build_info.txt")):
        if ":" in line:
            k, v = line.split(":", 1)
            info[k.strip()] = v.strip()
except OSError:
    pass
peer, disp, hyb = load("peer.json"), load("dispatch_bench.json"), load("hybridep_bench.json")

fig = {}  # (side, name) -> us
for r in (peer or {}).get("results", []):
    fig[("deepep", r["item"] + " " + r["dtype"])] = r["value"]
for r in (disp or {}).get("results", []):
    if r.get("unit") == "us":
        fig[("moert", r["name"])] = r["value"]
for v in (hyb or {}).get("variants", []):
    if v.get("tokens") == tokens and v.get("timing", "after_host_barrier") == "after_host_barrier":
        fig[("moert", v["name"] + " dispatch")] = v["dispatch_us"]
        fig[("moert", v["name"] + " combine")] = v["combine_us"]


def get(side, name):
    return fig.get((side, name))


def plus(*xs):
    return None if any(x is None for x in xs) else round(sum(xs), 2)


# the DeepEP references of each side, strictest (smallest) first is not assumed: each is named
refs = {
    **{"dispatch " + t: [
        ("DeepEP dispatch (cached handle: the copy kernel) + Megatron permute, one bracket",
         get("deepep", "dispatch_cached+permute " + t)),
        ("DeepEP layout + dispatch (notify, host wait, copy) + Megatron permute, one bracket",
         get("deepep", "layout+dispatch+permute " + t)),
        ("DeepEP dispatch (cached) + the row gather alone (a permute's floor), sum",
         plus(get("deepep", "dispatch_cached " + t), get("deepep", "permute_floor " + t))),
    ] for t in ("bf16", "fp8")},
    "combine bf16": [
        ("Megatron unpermute + DeepEP combine, one bracket", get("deepep", "unpermute+combine bf16")),
        ("DeepEP combine alone", get("deepep", "combine bf16")),
    ],
}
s = "%d SMs" % sms
mine = {
    "dispatch bf16": [("moert deepep, whole call, %s" % s, get("moert", "deepep dispatch bf16 %s" % s)),
                      ("moert hybridep, whole call, %s (tma)" % s, get("moert", "hybridep %s (tma) dispatch" % s)),
                      ("moert hybridep, whole call, 16 SMs (tma)", get("moert", "hybridep 16 SMs (tma) dispatch")),
                      ("moert deepep, NVLink phase alone, %s" % s, get("moert", "deepep dispatch bf16 %s nvlink" % s))],
    "dispatch fp8": [("moert deepep, whole call, %s" % s, get("moert", "deepep dispatch fp8 %s" % s)),
                     ("moert deepep, NVLink phase alone, %s" % s, get("moert", "deepep dispatch fp8 %s nvlink" % s))],
    "combine bf16": [("moert deepep, whole call, %s" % s, get("moert", "deepep combine bf16 %s" % s)),
                     ("moert hybridep, whole call, %s (tma)" % s, get("moert", "hybridep %s (tma) combine" % s)),
                     ("moert hybridep, whole call, 16 SMs (tma)", get("moert", "hybridep 16 SMs (tma) combine")),
                     ("moert deepep, NVLink phase alone, %s" % s, get("moert", "deepep combine bf16 %s nvlink" % s))],
}
comparison = []
for call in ("dispatch bf16", "dispatch fp8", "combine bf16"):
    target_name, target = refs[call][0]
    for name, us in mine[call]:
        whole = "whole call" in name
        row = {"call": call, "moert": name, "moert_us": us, "reference": target_name, "reference_us": target,
               "ratio": round(us / target, 3) if us and target else None}
        if whole and call.startswith("dispatch"):
            row["target_met"] = None if row["ratio"] is None else row["ratio"] <= 1.0
        row["against_each_reference"] = [{"reference": n, "reference_us": v,
                                          "ratio": round(us / v, 3) if us and v else None} for n, v in refs[call]]
        comparison.append(row)

results = [{"name": "%s: %s" % (c["call"], c["moert"]), "value": c["moert_us"], "unit": "us",
            "config": {"side": "moert", "gpus": ngpu, "tokens_per_rank": tokens}} for c in comparison]
for call, rs in refs.items():
    results += [{"name": "%s: %s" % (call, n), "value": v, "unit": "us",
                 "config": {"side": "deepep", "gpus": ngpu, "tokens_per_rank": tokens, "num_sms": sms}} for n, v in rs]
results += [{"name": "%s: %s / %s" % (c["call"], c["moert"], c["reference"]), "value": c["ratio"], "unit": "ratio",
             "config": {"gpus": ngpu}} for c in comparison]
shape = {"tokens_per_rank": tokens, "hidden": 7168, "topk": 8, "experts": 256, "routing": "uniform random top-k"}
if peer and peer.get("shape", {}).get("hidden") != 7168:
    shape["mismatch"] = "the peer ran hidden %s; moert's benches are fixed at 7168" % peer["shape"].get("hidden")
doc = {
    "command": command, "machine": machine, "gpus": ngpu, "card": card, "git": git,
    "date": datetime.date.today().isoformat(),
    "what": "DeepEP intranode (public source, no NVSHMEM) with Megatron's permute, against moert's deepep and "
            "hybridep whole calls, same shape, one call; figures: median over calls of the slowest rank's "
            "CUDA-event time (us)",
    "deepep_commit": info.get("deepep_commit", "unknown"), "deepep_build": info,
    "shape": shape, "num_sms": sms, "calls_per_figure": iters, "steps": steps,
    "log": "deepep-peer-%dgpu.log" % ngpu, "comparison": comparison, "results": results,
    "peer": peer, "moert": {"dispatch_bench": disp, "hybridep_bench": hyb},
    "notes": ["each side draws its own uniform routing (same shape and law, different draws)",
              "moert's whole calls exclude its prepare() (layout + count exchange, one host sync), as DeepEP's "
              "cached dispatch excludes its layout and notify; the layout+dispatch+permute bracket is what a "
              "Megatron step runs on DeepEP's side",
              "Megatron's permute here is its plain-torch path (no TransformerEngine on the machine); TE's fused "
              "permute would cost between the permute_floor figure and it",
              "hybridep has no FP8 dispatch"],
}
path = os.path.join(out, "deepep-peer-%dgpu.json" % ngpu)
with open(path, "w") as f:
    json.dump(doc, f, indent=1)
print("\n%-13s %-48s %10s %10s %7s" % ("call", "moert", "moert us", "ref us", "ratio"))
for c in comparison:
    f = lambda v: "%10.1f" % v if v is not None else "%10s" % "-"
    print("%-13s %-48s %s %s %7s%s" % (c["call"], c["moert"], f(c["moert_us"]), f(c["reference_us"]),
                                        "%.3f" % c["ratio"] if c["ratio"] is not None else "-",
                                        {True: "  met", False: "  NOT met"}.get(c.get("target_met"), "")))
print("reference per call: " + "; ".join("%s: %s" % (k, v[0][0]) for k, v in refs.items()))
print("wrote %s (DeepEP %s)" % (path, doc["deepep_commit"][:12]))
sys.exit(1 if any(st["rc"] for st in steps) or not peer or not disp or not hyb else 0)
PY
