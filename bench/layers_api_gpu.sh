#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The embedding API on a GPU machine, in one call: its checks against the CPU (tests/gpu/test_gpu_layers_api: ranks as
# threads on 1, 2 and 4 GPUs, a process per GPU with a caller-distributed NCCL id), then one layer's forward+backward
# through the API against the same layer in moert's own harness (`moert run`, stage times), at the per-GPU shapes of
# deepseek-v3 (64 local experts of EP4), qwen3-30b-a3b and mixtral-8x7b on GPU 0.
#   usage: bench/layers_api_gpu.sh BUILD_DIR OUT_DIR
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-/tmp/moert-layers-api}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 MOERT_TEST_SOURCE_ROOT="$PWD"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "layers API on $gpus x $card, git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
timeout 300 "$BUILD/tests/test_gpu_layers_api" >"$OUT/checks.log" 2>&1
echo "checks: rc $?"; cat "$OUT/checks.log"

shape() { # name config experts tokens
  local cfg="$OUT/$1.json"
  python3 - "$2" "$3" "$4" "$cfg" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["model"]["num_experts"] = int(sys.argv[2]); c["model"]["num_layers"] = 1
c["parallel"] = {"ranks": 1, "device": "cuda"}
c["train"]["tokens_per_rank"] = int(sys.argv[3]); c["train"]["steps"] = 12
json.dump(c, open(sys.argv[4], "w"))
PY
  for round in 1 2; do
    api=$(timeout 300 "$BUILD/tests/test_gpu_layers_api" --bench "$cfg" 2>>"$OUT/$1.err")
    timeout 300 "$BUILD/tools/moert" run "$cfg" --quiet --report "$OUT/$1-harness-$round.json" >>"$OUT/$1.err" 2>&1
    harness=$(python3 - "$OUT/$1-harness-$round.json" <<'PY'
import json, statistics, sys
steps = json.load(open(sys.argv[1]))["steps"][2:]
print("%.3f" % statistics.median(sum(s["stage_ms_rank0"].values()) for s in steps))
PY
)
    echo "$api" | python3 -c "
import json, sys
a = json.loads(sys.stdin.read()); h = float('$harness')
print('%-16s round $round: API fwd+bwd %8.3f ms   harness layer (stages) %8.3f ms   API/harness %.3f' % ('$1', a['value'], h, a['value'] / h))
a.update(name='$1', round=$round, harness_ms=h, ratio=a['value'] / h); print(json.dumps(a), file=open('$OUT/results.jsonl', 'a'))"
  done
}
shape deepseek-v3 configs/deepseek-v3.json 64 4096
shape qwen3-30b-a3b configs/qwen3-30b-a3b.json 32 8192
shape mixtral-8x7b configs/mixtral-8x7b.json 2 8192
shape deepseek-v3-shared configs/deepseek-v3-shared.json 64 4096
