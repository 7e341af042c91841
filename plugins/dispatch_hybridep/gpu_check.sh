#!/usr/bin/env bash
# The "hybridep" dispatcher's GPU checks and figures in one go, on a GPU machine (4 GPUs for the acceptance figures):
#   1. tests/test_gpu_hybridep: the CUDA path against the CPU path on 1/2/4/8 GPUs, a stalled peer, bad ids, the
#      low-latency tuning options, and CUDA-graph capture + replays (low-latency and normal mode)
#   2. bench/hybridep_bench: with MOERT_BENCH_ONLY=ll (the default here) the low-latency lines only: the launch floor,
#      T 1..256 on every SM, the block-count sweep, and the tuning variants beside the default at T 1/32/128/256;
#      MOERT_BENCH_ONLY=all: also dispatch/combine at 8, 12, 16 SMs (T 4096) with deepep at 24 SMs
# usage: plugins/dispatch_hybridep/gpu_check.sh BUILD_DIR OUT_DIR      (BUILD_DIR made with -Dcuda=enabled; no rebuild)
# Each step has its own time limit (130 + 80 s, killed 3 s after), so the script ends within 3.6 minutes even if a
# step hangs; both print progress line by line, so a killed step's log shows where it was.
set -u
BUILD=$(realpath "${1:-build}")
OUT=${2:-${OUT:-/tmp/moert-hybridep}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 MOERT_TEST_BUILD_ROOT="$BUILD" MOERT_TEST_SOURCE_ROOT="$PWD"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "hybridep GPU checks: $gpus GPU(s), build $BUILD"
status=0

start=$SECONDS
timeout -k 3 130 stdbuf -oL -eL "$BUILD/tests/test_gpu_hybridep" >"$OUT/test_gpu_hybridep.log" 2>&1
rc=$?
echo "== test_gpu_hybridep: rc $rc, $((SECONDS - start)) s"
sed -n '/^hybridep dispatcher, CUDA vs CPU/,$p' "$OUT/test_gpu_hybridep.log"
[ $rc -ne 0 ] && { status=1; grep -v '^ *$' "$OUT/test_gpu_hybridep.log" | grep -v '^world .*: \(open\|CPU reference\|CUDA step\|compare\|done\)' | head -30; tail -3 "$OUT/test_gpu_hybridep.log"; }

start=$SECONDS
bench_only=${MOERT_BENCH_ONLY:-ll}
[ "$bench_only" = all ] && bench_only=
MOERT_BENCH_ONLY=$bench_only MOERT_BENCH_MACHINE=${MOERT_BENCH_MACHINE:-nvidia-h200-x$gpus} MOERT_BENCH_GIT=${MOERT_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} \
  timeout -k 3 $([ -n "$bench_only" ] && echo 80 || echo 150) stdbuf -oL -eL "$BUILD/bench/hybridep_bench" "$OUT/hybridep_bench.json" >"$OUT/hybridep_bench.log" 2>&1
rc=$?
echo "== hybridep_bench: rc $rc, $((SECONDS - start)) s"
grep -v "^variant " "$OUT/hybridep_bench.log" | tail -75
[ $rc -ne 0 ] && status=1
exit $status
