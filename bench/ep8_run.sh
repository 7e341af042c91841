#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# EP8 figures on one 8-GPU host (nvidia-h200-x8), all from a build made elsewhere with -Dcuda=enabled:
#   1. correctness at 1, 2, 4, 8 GPUs: tests/test_gpu_plugins (alltoall) and every deepep/hybridep GPU test built
#   2. bench/dispatch_bench (deepep, alltoall) and bench/hybridep_bench at EP8: dispatch bf16 / fp8 and combine,
#      time and GB/s (JSON)
#   3. moert ab, bf16 (A) vs fp8 current scaling (B), one layer forward+backward at EP8, for the deepseek-v3 and
#      qwen3-235b-a22b presets (dispatcher deepep on both sides; EP8_DISPATCHER overrides)
# usage: bench/ep8_run.sh BUILD_DIR OUT_DIR
# Each step has its own time limit, so the script ends within about 8 minutes even if a step hangs.
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-/tmp/moert-ep8}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 MOERT_TEST_BUILD_ROOT="$BUILD" MOERT_TEST_SOURCE_ROOT="$PWD"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dispatcher=${EP8_DISPATCHER:-deepep}
echo "EP8 run: $gpus GPU(s), build $BUILD, git $rev, $(date -u +%Y-%m-%dT%H:%MZ)"
status=0

step() { # name, limit_s, command...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout -k 3 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: rc $rc, $((SECONDS - start)) s"
  [ $rc -ne 0 ] && [ $rc -ne 77 ] && status=1
  return $rc
}

for t in test_gpu_plugins test_gpu_deepep test_gpu_hybridep; do
  [ -x "$BUILD/tests/$t" ] || continue
  step "$t" 100 "$BUILD/tests/$t"
  grep -E '^(world|[0-9] |stall|[a-z_]+: [0-9]+ (checks|failures))|FAIL|ok$' "$OUT/$t.log" | tail -60
done

MOERT_BENCH_MACHINE=nvidia-h200-x$gpus MOERT_BENCH_GIT=$rev MOERT_BENCH_SMS=${EP8_SMS:-24,0} \
  step dispatch_bench 120 "$BUILD/bench/dispatch_bench" "$OUT/dispatch-bench-ep$gpus.json"
tail -22 "$OUT/dispatch_bench.log"
if [ -x "$BUILD/bench/hybridep_bench" ]; then
  MOERT_BENCH_MACHINE=nvidia-h200-x$gpus MOERT_BENCH_GIT=$rev \
    step hybridep_bench 90 "$BUILD/bench/hybridep_bench" "$OUT/hybridep-bench-ep$gpus.json"
  grep -E '^ +(hybridep|deepep)' "$OUT/hybridep_bench.log"
fi

for preset in deepseek-v3 qwen3-235b-a22b; do
  step "ab-$preset-bf16-vs-fp8" 150 "$BUILD/tools/moert" ab "configs/$preset.json" "configs/$preset.json" \
    --set "parallel.ranks=$gpus" --set parallel.device=cuda --set "dispatcher.plugin=\"$dispatcher\"" \
    --set-b 'precision.plugin="fp8"' --set-b 'precision.recipe="current"' \
    --warmup 2 --steps 6 --quiet --report "$OUT/ab-$preset-bf16-vs-fp8-ep$gpus.json"
  grep -v '^[AB] step' "$OUT/ab-$preset-bf16-vs-fp8.log" | tail -32
done
exit $status
