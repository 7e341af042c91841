#!/usr/bin/env bash
# The "deepep" dispatcher's GPU checks and figures in one go, on a GPU machine (4 GPUs for all of it):
#   1. tests/test_gpu_deepep: the CUDA path against the CPU path on 1, 2, 4 GPUs, and a stalled peer
#   2. bench/dispatch_bench: deepep dispatch bf16 / fp8 and combine at 8, 12, 16, 24 and all SMs, each as the whole
#      call and as its NVLink phase alone ("nvlink"), against alltoall (JSON)
#   3. moert ab: the deepseek-v3 layer, forward+backward, alltoall (A) against deepep (B) in the same process
# usage: plugins/dispatch_deepep/gpu_check.sh BUILD_DIR OUT_DIR      (BUILD_DIR made with -Dcuda=enabled)
# It never builds. Each step has its own time limit (75 + 130 + 90 s, killed 3 s after), so the script ends within 5 minutes
# even if a step hangs; the test and the bench print progress line by line, so a killed step's log shows where it was.
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-${OUT:-/tmp/moert-deepep}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 MOERT_TEST_BUILD_ROOT="$BUILD" MOERT_TEST_SOURCE_ROOT="$PWD"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "deepep GPU checks: $gpus GPU(s), build $BUILD"
status=0

start=$SECONDS
timeout -k 3 75 "$BUILD/tests/test_gpu_deepep" >"$OUT/test_gpu_deepep.log" 2>&1
rc=$?
echo "== test_gpu_deepep: rc $rc, $((SECONDS - start)) s"
sed -n '/^deepep dispatcher, CUDA vs CPU/,$p' "$OUT/test_gpu_deepep.log"
[ $rc -ne 0 ] && { status=1; grep -v '^ *$' "$OUT/test_gpu_deepep.log" | grep -v '^world .*: \(open\|CPU reference\|CUDA step\|compare\|done\)' | head -30; tail -3 "$OUT/test_gpu_deepep.log"; }

start=$SECONDS
MOERT_BENCH_MACHINE=${MOERT_BENCH_MACHINE:-nvidia-h200-x$gpus} MOERT_BENCH_GIT=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} \
  timeout -k 3 130 "$BUILD/bench/dispatch_bench" "$OUT/dispatch_bench.json" >"$OUT/dispatch_bench.log" 2>&1
rc=$?
echo "== dispatch_bench: rc $rc, $((SECONDS - start)) s"
if grep -q '^dispatch_bench: EP' "$OUT/dispatch_bench.log"; then sed -n '/^dispatch_bench: EP/,$p' "$OUT/dispatch_bench.log"
else tail -15 "$OUT/dispatch_bench.log"; fi
[ $rc -ne 0 ] && status=1

if [ "$gpus" -ge 4 ]; then
  start=$SECONDS
  timeout -k 3 90 "$BUILD/tools/moert" ab configs/deepseek-v3.json configs/deepseek-v3.json --set-b dispatcher.plugin=deepep \
    --warmup 2 --steps 6 --quiet --report "$OUT/ab-deepseek-v3-alltoall-vs-deepep.json" >"$OUT/ab.log" 2>&1
  rc=$?
  echo "== moert ab deepseek-v3 alltoall (A) vs deepep (B): rc $rc, $((SECONDS - start)) s"
  tail -30 "$OUT/ab.log"
  [ $rc -ne 0 ] && status=1
fi
exit $status
