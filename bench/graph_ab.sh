#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CUDA graphs against eager: the whole DeepSeek-V3 layer (EP = every visible GPU, bf16) replayed from CUDA graphs (B,
# $.parallel.cuda_graph "on") against the same stack run eagerly (A, "off"), at 128, 512 and 4096 tokens per rank,
# in one call. The stack is the capturable one: router without a loss, dispatcher hybridep (low-latency mode at 128,
# from its "auto"), precision bf16 with "gemm": "kernel" (moert's grouped GEMM reading the counts on the device).
# Then, for scale, the same eager stack against the default cuBLASLt GEMMs (which sync the host for their counts).
#   usage: bench/graph_ab.sh BUILD_DIR OUT_DIR [TOKENS ...]      (default tokens: 128 512 4096)
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-/tmp/moert-graph-ab}
shift 2 2>/dev/null || shift $#
TOKENS=("$@")
[ ${#TOKENS[@]} -eq 0 ] && TOKENS=(128 512 4096)
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$gpus" -ge 4 ] && ranks=4 || ranks=$gpus
[ "$ranks" -lt 1 ] && { echo "graph_ab: no GPU"; exit 77; }
common=(--warmup 3 --steps 12 --set parallel.device=cuda --set "parallel.ranks=$ranks" --set 'train.data="repeat"'
        --set 'dispatcher.plugin="hybridep"' --set 'precision.gemm="kernel"' --set train.log_every=100)
run_ab() { # name, options...
  local name=$1; shift
  echo "== $name: moert ab configs/deepseek-v3.json configs/deepseek-v3.json ${common[*]} $*"
  timeout 240 "$BUILD/tools/moert" ab configs/deepseek-v3.json configs/deepseek-v3.json "${common[@]}" "$@" \
    --report "$OUT/graph-ab-$name.json" 2>&1 | tee "$OUT/graph-ab-$name.log" | grep -v '^[AB] step'
}
for t in "${TOKENS[@]}"; do
  run_ab "t$t" --set "train.tokens_per_rank=$t" --set-a 'parallel.cuda_graph="off"' --set-b 'parallel.cuda_graph="on"'
done
run_ab "cublaslt-vs-kernel-t4096" --set train.tokens_per_rank=4096 --set 'parallel.cuda_graph="off"' \
  --set-a 'precision.gemm="cublaslt"'
python3 - "$OUT" "${TOKENS[@]}" <<'PY'
import json, os, sys
out, tokens = sys.argv[1], sys.argv[2:]
print("\n%-8s %-14s %-14s %-8s %-14s %-14s %-8s %s" % ("tokens", "eager step ms", "graph step ms", "B/A",
      "eager layer ms", "graph layer ms", "B/A", "agree"))
for t in tokens:
    p = os.path.join(out, "graph-ab-t%s.json" % t)
    if not os.path.exists(p):
        print("%-8s no report" % t); continue
    r = json.load(open(p))
    a, b = r["a"]["ms"], r["b"]["ms"]
    print("%-8s %-14.3f %-14.3f %-8.3f %-14.3f %-14.3f %-8.3f %s   B: %s" % (t, a["step"]["median"], b["step"]["median"],
          r["b_over_a"]["step"], a["layer"]["median"], b["layer"]["median"], r["b_over_a"]["layer"],
          r["agreement"]["agree"], r["b"].get("cuda_graph", "?")))
PY
