#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# MoE Parallel Folding on GPUs (docs/parallel.md), in one call: one MoE layer's forward+backward time in steady state
# and the peak device memory per GPU, for the expert layouts of the same GPUs, through `moert run` (one layer, bf16,
# alltoall, SGD, a thread per GPU):
#   NGPUS=4: deepseek-v3 (256 experts) EP4 vs EP2 x EDP2, mixtral-8x7b (8 experts) EP4 vs EP2 x ETP2;
#   NGPUS=2: deepseek-v3 with 128 experts (64 a GPU at EP2, as at EP4 with 256) and mixtral-8x7b, each
#            EP2 vs EP1 x EDP2 vs EP1 x ETP2.
# Layer time: the sum of rank 0's stage times of a step (forward and backward of the layer), the median of steps 4-20;
# the step time adds the expert gradients' sum over EDP and the optimizer. Memory: rank 0's pool peak (in use) and
# each GPU's largest memory.used seen by nvidia-smi during the run (context, NCCL and cached blocks included). SGD keeps
# EP2 x EDP2's 128 local experts of deepseek-v3 (weights and gradients in fp32) within an H100's memory.
# Writes OUT/folding-<NGPUS>gpu.json (command, machine: the GPUs' nvidia-smi name, date, git revision, one row per run)
# and prints a table; each run's log, report and memory samples go to OUT too. Exits 1 when a run failed.
#   usage: bench/folding_gpu.sh BUILD_DIR OUT_DIR [NGPUS]      (NGPUS: 4 or 2; default: 4 if 4 GPUs answer, else 2)
set -u
BUILD=$(realpath "${1:?usage: bench/folding_gpu.sh BUILD_DIR OUT_DIR [NGPUS]}")
OUT=$(mkdir -p "${2:?usage: bench/folding_gpu.sh BUILD_DIR OUT_DIR [NGPUS]}" && realpath "$2")
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
MOERT="$BUILD/tools/moert"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPUS=${3:-$([ "$gpus" -ge 4 ] && echo 4 || echo 2)}
case "$NGPUS" in 2 | 4) ;; *) echo "folding_gpu.sh: NGPUS is 2 or 4, not $NGPUS" >&2; exit 2 ;; esac
[ "$gpus" -ge "$NGPUS" ] || { echo "folding_gpu.sh: $NGPUS GPUs wanted, $gpus answer" >&2; exit 77; }
[ -x "$MOERT" ] || { echo "folding_gpu.sh: $MOERT is not built" >&2; exit 2; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# MOERT_BENCH_GIT names the revision where the checkout's .git is missing or stale (docs/benchmarks.md, "Recording results")
git=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
command="bench/folding_gpu.sh $*"
echo "MoE Parallel Folding: $NGPUS x $card, git $git"
rm -f "$OUT/runs.jsonl"

# run NAME PRESET EXPERTS ETP EDP: one `moert run`, sampled by nvidia-smi, its row appended to runs.jsonl
run() {
  local name=$1 preset=$2 experts=$3 etp=$4 edp=$5
  local smi="$OUT/$name.smi.csv" report="$OUT/$name.json" log="$OUT/$name.log"
  rm -f "$report"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 100 >"$smi" 2>/dev/null &
  local sampler=$!
  timeout 240 "$MOERT" run "configs/$preset.json" --quiet --steps 20 --set parallel.device='"cuda"' \
    --set parallel.ranks="$NGPUS" --set parallel.expert_tensor_parallel="$etp" \
    --set parallel.expert_data_parallel="$edp" --set model.num_layers=1 --set model.num_experts="$experts" \
    --set 'train.optimizer="sgd"' --set 'dispatcher.plugin="alltoall"' --report "$report" >"$log" 2>&1
  local rc=$?
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  python3 - "$name" "$preset" "$experts" "$NGPUS" "$etp" "$edp" "$rc" "$report" "$smi" "$log" \
    >>"$OUT/runs.jsonl" <<'PY'
import json, os, statistics, sys
name, preset, experts, ngpus, etp, edp, rc, report, smi, log = sys.argv[1:11]
experts, ngpus, etp, edp, rc = int(experts), int(ngpus), int(etp), int(edp), int(rc)
ep = ngpus // (etp * edp)
row = {"name": name, "preset": preset, "layout": "EP%d x ETP%d x EDP%d" % (ep, etp, edp), "ep": ep, "etp": etp,
       "edp": edp, "num_experts": experts, "local_experts": experts // ep, "rc": rc}
peak = {}
if os.path.exists(smi):
    for line in open(smi):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) < ngpus:
            peak[int(parts[0])] = max(peak.get(int(parts[0]), 0), int(parts[1]))
row["gpu_memory_used_max_mib"] = [peak.get(i) for i in range(ngpus)]
try:
    r = json.load(open(report))
    steps = r["steps"][3:]
    row["tokens_per_rank"] = r["tokens_per_rank"]
    row["layer_fwd_bwd_ms"] = statistics.median(sum(s["stage_ms_rank0"].values()) for s in steps)
    row["step_ms"] = statistics.median(s["step_ms"] for s in steps)
    row["stage_ms"] = r["median_ms"]
    row["pool_peak_gib_rank0"] = r.get("device_pool_peak_bytes_rank0", 0) / 2**30
    row["steps_timed"] = len(steps)
except (OSError, KeyError, ValueError, statistics.StatisticsError) as e:
    tail = open(log).read().strip().splitlines()[-3:] if os.path.exists(log) else []
    row["error"] = "%s; %s" % (e, " | ".join(tail))
print(json.dumps(row))
PY
  [ $rc -eq 0 ] || { echo "$name: moert run failed (rc $rc), log $log"; tail -5 "$log"; }
}

if [ "$NGPUS" -eq 4 ]; then
  run deepseek-v3-ep4 deepseek-v3 256 1 1
  run deepseek-v3-ep2-edp2 deepseek-v3 256 1 2
  run mixtral-8x7b-ep4 mixtral-8x7b 8 1 1
  run mixtral-8x7b-ep2-etp2 mixtral-8x7b 8 2 1
else
  for layout in "ep2 1 1" "ep1-edp2 1 2" "ep1-etp2 2 1"; do
    set -- $layout
    run "deepseek-v3-e128-$1" deepseek-v3 128 "$2" "$3"
    run "mixtral-8x7b-$1" mixtral-8x7b 8 "$2" "$3"
  done
fi

python3 - "$OUT" "$NGPUS" "$card" "$git" "$command" <<'PY'
import datetime, json, os, sys
out, ngpus, card, git, command = sys.argv[1:6]
rows = [json.loads(l) for l in open(os.path.join(out, "runs.jsonl")) if l.strip()]
doc = {"command": command, "machine": "%s x %s" % (ngpus, card), "gpus": int(ngpus), "git": git,
       "date": datetime.date.today().isoformat(),
       "what": "one MoE layer (bf16, alltoall, SGD, a thread per GPU) through moert run, 20 steps: layer_fwd_bwd_ms is "
               "the median over steps 4-20 of rank 0's stage sum (forward and backward of the layer), step_ms the "
               "median step (with the expert gradients' sum over EDP and the optimizer); memory: rank 0's pool peak "
               "in use and each GPU's largest memory.used from nvidia-smi (sampled every 100 ms)",
       "runs": rows}
path = os.path.join(out, "folding-%sgpu.json" % ngpus)
json.dump(doc, open(path, "w"), indent=1)
f = lambda v, p: (p % v) if isinstance(v, (int, float)) else "-"  # noqa: E731
print("%-28s %-20s %7s %12s %9s %10s  %s" % ("run", "layout", "experts", "layer ms", "step ms", "pool GiB",
                                           "GPU memory used, max MiB"))
for r in rows:
    print("%-28s %-20s %7s %12s %9s %10s  %s" % (r["name"], r["layout"], r["local_experts"],
                                               f(r.get("layer_fwd_bwd_ms"), "%.3f"), f(r.get("step_ms"), "%.3f"),
                                               f(r.get("pool_peak_gib_rank0"), "%.2f"),
                                               " ".join(str(m) for m in r["gpu_memory_used_max_mib"])))
    if "error" in r:
        print("    error: %s" % r["error"][:300])
print("wrote %s" % path)
sys.exit(1 if any(r.get("rc") or "error" in r for r in rows) else 0)
PY
