#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The memory policies' A/Bs: a stack of 4 DeepSeek-V3 layers, EP4, bf16, against "keep":
#   recompute of fc1_out and swiglu_out (>= 30% less activation memory at <= 10% step time),
#   offload of dispatched_x (<= 5% step time; the last layer keeps it: offload_last_layer false).
# Two runtimes of 4 such layers (28 GB of weights, grads and bf16 copy per layer and rank) do not fit in one
# H200 together, so the A/Bs run --sequential, with plain SGD (no Adam moments).
#   usage: bench/memory_ab.sh BUILD_DIR OUT_DIR [LAYERS [--set KEY=JSON ...]]
#   MEMORY_AB_ONLY=recompute or =offload runs one of the two A/Bs
#   e.g. --set train.input_shift=0 for routing as even as a balanced model's (the default input shift sends
#   rank 0 ~4x the mean rows at the start, and offload copies scale with rank 0's rows)
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-/tmp/moert-memory-ab}
LAYERS=${3:-4}
shift 3 2>/dev/null || shift $#
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
common=(--sequential --warmup 2 --steps 8 --set parallel.device=cuda --set "model.num_layers=$LAYERS"
        --set 'train.optimizer="sgd"' --set train.log_every=5 "$@")
run_ab() { # name, B's --set-b options...
  local name=$1; shift
  echo "== $name: moert ab configs/deepseek-v3.json configs/deepseek-v3.json ${common[*]} $*"
  timeout 280 "$BUILD/tools/moert" ab configs/deepseek-v3.json configs/deepseek-v3.json "${common[@]}" "$@" \
    --report "$OUT/ab-$name.json" 2>&1 | tee "$OUT/ab-$name.log" | grep -v '^[AB] step'
}
only=${MEMORY_AB_ONLY:-}
[ "$only" != offload ] && run_ab recompute --set-b 'memory_policy.fc1_out="recompute"' --set-b 'memory_policy.swiglu_out="recompute"'
[ "$only" != recompute ] && run_ab offload --set-b 'memory_policy.dispatched_x="offload"' --set-b 'memory_policy.offload_last_layer=false'
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
limits = {"recompute": (1.10, 0.70), "offload": (1.05, None)}
for name, (step_max, kept_max) in limits.items():
    p = os.path.join(out, "ab-%s.json" % name)
    if not os.path.exists(p):
        print("%-9s no report" % name); continue
    r = json.load(open(p))
    step, kept = r["b_over_a"]["step"], r["b_over_a"]["kept_from_forward_to_backward"]
    ok = step <= step_max and (kept_max is None or kept <= kept_max) and r["agreement"]["agree"]
    print("%-9s step B/A %.3f (limit %.2f), kept B/A %.3f%s, agree %s: %s" % (
        name, step, step_max, kept, "" if kept_max is None else " (limit %.2f)" % kept_max,
        r["agreement"]["agree"], "PASS" if ok else "MISS"))
PY
